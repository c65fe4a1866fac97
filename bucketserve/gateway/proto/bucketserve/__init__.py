"""Package `bucketserve.v1` of the serving API."""
