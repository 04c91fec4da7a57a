"""Integration tests: real etcd, Redis and gRPC servers on loopback."""
