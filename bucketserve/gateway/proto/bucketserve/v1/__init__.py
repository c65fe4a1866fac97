"""Generated stubs of `bucketserve.v1`; do not edit, regenerate."""
