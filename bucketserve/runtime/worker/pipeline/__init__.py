"""Pipeline parallelism: a model split into stages of contiguous layers, run as a pipeline."""
