"""A request's deadline, set once when it reaches the router (absolute, on the router's monotonic clock).

Rule: a request may only shorten the server's limit, as in Triton: the earlier of its transport deadline
and its `timeout` parameter, else the default, never further than `max_timeout_s`.
"""

from __future__ import annotations

from sluice_inference.common.config import RouterSettings


def deadline_for(
    settings: RouterSettings, now: float, time_remaining: float | None, timeout_s: float | None
) -> float:
    """A request's deadline: the earlier of its transport deadline and `parameters["timeout"]`, else the
    default; never further than `max_timeout_s` (a request may only shorten the server's limit)."""
    budgets = [t for t in (time_remaining, timeout_s) if t is not None]
    return now + min(*(budgets or [settings.default_timeout_s]), settings.max_timeout_s)
