"""Shared by prefill and decode workers: the KVWorker base class, its config, its
environment (threads, padding, warm-up) and the pipeline-stage actors."""
