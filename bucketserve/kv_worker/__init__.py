"""Shared by prefill and decode workers: the KVWorker base class, its config, and the
messages that cross process boundaries (bucketserve.messages)."""
