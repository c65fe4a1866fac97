"""Tensor parallelism within a worker: the head rank's runner and the other ranks' loop."""
