"""What the router and the worker share: config, tensors, errors, clock, etcd registry, client, stubs.

Rule: nothing here imports `router` or `worker`.
"""
