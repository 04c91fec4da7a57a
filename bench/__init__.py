"""Benchmarks and (later) the load generator and simulator. May import common/ and router/policy/."""
