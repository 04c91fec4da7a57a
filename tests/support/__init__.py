"""Helpers shared by tests: real servers on free loopback ports (etcd) and other fixtures."""
