"""Tensor parallelism's collectives: the group a worker's ranks form, the all-reduce and
all-gather the parallel layers call (custom ops inside a compiled region)."""
