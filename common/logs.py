"""Structured logs: one JSON object per line, carrying the request id and trace id of the request being
served, so a log line can be joined with its trace and its client's report.

Rule: no payloads in logs — tensors, inputs and outputs are never formatted into a message; log what
happened (model, version, sizes, status), not the data.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

from opentelemetry.trace import get_current_span

from common.clock import Clock

REQUEST_ID: ContextVar[str] = ContextVar("sluice_request_id", default="")
"""The id of the request being served in this task (the client's `id`, or its trace id)."""


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "request_id", "trace_id", "span_id", "component", "exc"}`."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        """One JSON line."""
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "component": self._component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        context = get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = f"{context.trace_id:032x}"
            entry["span_id"] = f"{context.span_id:016x}"
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, component: str, *, as_json: bool = True) -> None:
    """Log to stderr, as JSON lines (default) or plain text for humans."""
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter(component))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class LogThrottle:
    """Logs an event at most once per interval, with how many occurred since the last line: for events a
    client controls (malformed bodies, refused requests), so their rate can never become a log flood."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock: Clock) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log `message % args` (plus the count suppressed since the last line) unless one was logged less
        than an interval ago; whether it was logged."""
        now = self._clock.now()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return False
        suffix = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self._logger.warning(message + suffix, *args)
        self._last, self._suppressed = now, 0
        return True
