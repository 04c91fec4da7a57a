"""Structured logs carry the request id and the trace id of the request being served."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.logs import MAX_LOGGED_ID, REQUEST_ID, JsonFormatter, LogThrottle, loggable_id


def test_a_log_line_inside_a_request_names_its_request_and_trace() -> None:
    formatter = JsonFormatter("router")
    record = logging.LogRecord(
        "sluice_inference.router.driver", logging.WARNING, __file__, 1, "worker %s lost", ("w1",), None
    )
    tracer = TracerProvider().get_tracer("t")
    token = REQUEST_ID.set("req-7")
    try:
        with tracer.start_as_current_span("sluice.infer") as span:
            line = json.loads(formatter.format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["msg"] == "worker w1 lost" and line["level"] == "WARNING" and line["component"] == "router"
    assert line["request_id"] == "req-7"
    assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}"


def test_outside_a_request_there_is_no_request_or_trace_id() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "started", (), None)
    line = json.loads(JsonFormatter("worker").format(record))
    assert "request_id" not in line and "trace_id" not in line


def test_a_client_chosen_id_is_cut_and_escaped_before_it_reaches_a_log_line() -> None:
    assert loggable_id("req-1") == "req-1"
    assert loggable_id("a\\n") == "a\\\\n"  # a backslash is escaped too: no line of it reads as "\n"
    forged = loggable_id('x\n{"level": "CRITICAL"}\x1b[2J')
    assert "\n" not in forged and "\x1b" not in forged and forged.startswith("x\\n")
    long = loggable_id("a" * 20_000)
    assert len(long) == MAX_LOGGED_ID + 1 and long.endswith("…")


def test_a_throttled_exception_logs_one_traceback_per_interval_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    throttle = LogThrottle(logging.getLogger("throttled"), 5.0, clock)
    with caplog.at_level(logging.ERROR, logger="throttled"):
        for _ in range(3):
            try:
                raise ValueError("client-triggered")
            except ValueError:
                throttle.exception("request failed")
        clock.advance(5.0)
        try:
            raise ValueError("again")
        except ValueError:
            throttle.exception("request failed")
    assert [r.getMessage() for r in caplog.records] == [
        "request failed",
        "request failed (2 more since the last report)",
    ]
    assert all(r.exc_info is not None and r.levelno == logging.ERROR for r in caplog.records)
