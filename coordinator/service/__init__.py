"""The process edge: the gRPC server and servicer, call admission, limits, shutdown."""
