"""The `sluice` command: composes router, worker, local cluster and client commands.

It lives outside `common/` because it imports both sides (docs/design.md §2 forbids that in `common/`); see
docs/architecture.md.
"""
