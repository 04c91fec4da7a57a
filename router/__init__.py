"""The stateless router: the gRPC shell at the top of this package, the pure policy core in `policy/`."""
