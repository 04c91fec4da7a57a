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

from sluice_inference.common.clock import Clock

REQUEST_ID: ContextVar[str] = ContextVar("sluice_request_id", default="")
"""The id of the request being served in this task (the client's `id`, or its trace id)."""

MAX_LOGGED_ID = 128
"""Longest client-chosen id a log line carries (a 20,000-character id made every line of its request
21 KB long)."""


def loggable_id(value: str) -> str:
    """A client-chosen id as logs may carry it: at most `MAX_LOGGED_ID` characters, escaped to printable
    ASCII (no line breaks or control characters a client could forge lines with), a cut one ending "…".
    Most ids need no escaping: they are returned as they are, without the copies escaping makes."""
    if len(value) <= MAX_LOGGED_ID and value.isascii() and value.isprintable() and "\\" not in value:
        return value
    shown = value[:MAX_LOGGED_ID].encode("unicode_escape").decode("ascii")
    return shown + ("…" if len(value) > MAX_LOGGED_ID else "")


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
        return self._log(logging.WARNING, message, args, with_traceback=False)

    def exception(self, message: str, *args: object) -> bool:
        """As `warning`, at ERROR and with the exception being handled (its traceback), for unexpected
        failures a client can trigger at will."""
        return self._log(logging.ERROR, message, args, with_traceback=True)

    def _log(self, level: int, message: str, args: tuple[object, ...], *, with_traceback: bool) -> bool:
        now = self._clock.now()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return False
        suffix = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self._logger.log(level, message + suffix, *args, exc_info=with_traceback)
        self._last, self._suppressed = now, 0
        return True
