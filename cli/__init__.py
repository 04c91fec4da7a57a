"""The `sluice` command: composes router, worker, local cluster and client commands.

It lives outside `common/` because it imports both sides (DESIGN.md §2 forbids that in `common/`); see
docs/architecture.md.
"""
