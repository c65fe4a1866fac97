"""Peer comparisons: bucketserve against other engines on the same machine and weights."""
