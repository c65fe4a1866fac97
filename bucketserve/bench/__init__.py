"""`bucketserve bench`: a load generator for the gRPC API or any OpenAI-compatible server
(seeded workloads, Poisson or closed-loop load, latency percentiles, SLO attainment and
goodput), and `--compare`, which starts the service in several configurations itself."""
