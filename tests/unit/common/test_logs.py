"""Structured logs carry the request id and the trace id of the request being served."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from common.logs import REQUEST_ID, JsonFormatter


def test_a_log_line_inside_a_request_names_its_request_and_trace() -> None:
    formatter = JsonFormatter("router")
    record = logging.LogRecord("router.driver", logging.WARNING, __file__, 1, "worker %s lost", ("w1",), None)
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
