"""The policy core: every decision the router makes, as plain objects driven by `now` and events.

Rule (docs/design.md §3): nothing in this package awaits, sleeps, reads a clock or does I/O, and it imports
no grpc, asyncio, etcd or Redis. The asyncio shell and the simulator feed it the same events.
"""
