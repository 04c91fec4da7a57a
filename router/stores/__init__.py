"""Stores that do the I/O behind the policy core's cache and idempotency semantics (docs/design.md §2).

`router/policy/cache_keys.py`, `result_cache.py` and `idempotency.py` decide what a key is, what a record
means and which transition happens; the classes here read and write (process memory, Redis), wait, and feed
what they read back to those functions. Nothing here raises a Redis exception to its caller: the cache
degrades to a miss, idempotency fails closed with `Unavailable(reason="idempotency_store_down")`.
"""
