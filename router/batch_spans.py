"""The trace spans of batches in flight: one per batch that carries a traced request, opened when the batch
is cut and ended when it is answered, fails or its worker is lost.

A batch span is linked to the span of every request it carries (a batch serves many traces, so it is the
child of none), and its context travels in the wire batch, so the worker's span becomes its child. With no
tracer configured nothing is opened, and the requests carried no span to link to in the first place.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode, Tracer

from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.telemetry import inject
from sluice_inference.router.policy.outcomes import Dispatch


class BatchSpans:
    """The open batch spans, by batch id, with the worker each batch went to."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._open: dict[int, tuple[str, Span]] = {}

    def open(
        self, dispatch: Dispatch, batch: worker_pb2.Batch, requests: Sequence[SpanContext | None]
    ) -> None:
        """Open the batch's span, linked to the spans of the requests it carries (`requests`: each one's,
        None for one untraced), and put its context in the wire batch; nothing when none is traced."""
        links = [Link(span) for span in requests if span is not None]
        if not links:
            return
        span = self._tracer.start_span(
            "sluice.batch",
            links=links,
            attributes={
                "sluice.model": dispatch.lane.model,
                "sluice.version": dispatch.lane.version,
                "sluice.batch_rows": dispatch.rows,
                "sluice.worker": dispatch.worker_id,
                "sluice.cut_reason": dispatch.reason,
            },
        )
        batch.trace_context.update(inject(span))
        self._open[dispatch.batch_id] = (dispatch.worker_id, span)

    def end(self, batch_id: int, error: str = "") -> None:
        """End the batch's span, if it has one: with an error status when `error` says why it failed."""
        entry = self._open.pop(batch_id, None)
        if entry is not None:
            if error:
                entry[1].set_status(Status(StatusCode.ERROR, error))
            entry[1].end()

    def end_worker(self, worker_id: str, error: str) -> None:
        """End the spans of every batch on a worker that is gone, with `error`."""
        for batch_id in [b for b, (w, _) in self._open.items() if w == worker_id]:
            self.end(batch_id, error)

    def end_all(self, error: str) -> None:
        """End every open span with `error` (the router abandons what it holds)."""
        for batch_id in list(self._open):
            self.end(batch_id, error)
