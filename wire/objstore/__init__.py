"""S3-compatible object storage, as both the coordinator and the sites use it."""
