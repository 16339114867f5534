"""The bytes between coordinator, workers and parameter servers: gRPC calls, the wire format, pickled functions."""
