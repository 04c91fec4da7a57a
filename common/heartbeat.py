"""The worker stream's heartbeat, as both ends keep it: how often a worker reports its load, and how long
a router lets a stream stay silent before it calls the worker frozen or cut off.

A worker that holds batches reports every `BUSY_REPORT_INTERVAL_S`; an idle one may report less often, but
only to a router that sends `REPORT_INTERVAL_METADATA` on the stream, and then every report says when the
next is due (`LoadReport.report_interval_ms`). A router allows `SILENCE_MARGIN_S` past that (a busy
worker's stream is silent for 0.8 s, three intervals and a bit, before it is closed) and, while batches
it sent are unanswered, never more than `STREAM_SILENCE_S` from the later of its last message and the
send that put work on an idle worker (worker/report_cadence.py, router/worker_link.py).
"""

from __future__ import annotations

from collections.abc import Iterable

BUSY_REPORT_INTERVAL_S = 0.25
"""A worker that holds batches, or was sent one since its last report, reports this often."""
STREAM_SILENCE_S = 0.8
"""A busy worker's stream silent this long belongs to a frozen or cut-off worker (gRPC keepalive alone
takes ~1.5 s to say so): it is closed and its batches re-dispatched."""
SILENCE_MARGIN_S = STREAM_SILENCE_S - BUSY_REPORT_INTERVAL_S
"""What a router allows past the announced time of a worker's next report."""
MAX_REPORT_INTERVAL_S = 5.0
"""The longest announced interval a router believes (a worker's own setting is bounded the same)."""
REPORT_INTERVAL_METADATA = "sluice-reads-report-interval"
"""Stream metadata a router sends when it reads `report_interval_ms` (any value)."""


def reads_report_interval(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a stream's router said it reads `report_interval_ms` (its call metadata)."""
    return any(key == REPORT_INTERVAL_METADATA for key, _ in metadata or ())


def silence_bound_s(report_interval_ms: int) -> float:
    """How long a stream may stay silent after a report announcing `report_interval_ms` (0: unsaid)."""
    interval_s = min(report_interval_ms / 1000.0, MAX_REPORT_INTERVAL_S)
    return max(STREAM_SILENCE_S, interval_s + SILENCE_MARGIN_S)
