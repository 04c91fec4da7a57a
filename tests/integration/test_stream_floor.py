"""bench/stream_floor.py: a real grpc.aio echo server in a child process, exchanges over a Unix socket."""

from __future__ import annotations

from pathlib import Path

from sluice_inference.bench import stream_floor


def test_both_ends_of_an_exchange_are_measured_over_a_unix_socket(tmp_path: Path) -> None:
    client, server = stream_floor.measure(f"unix:{tmp_path}/floor.sock", 1000, 300, core=0)
    assert 0 < client < 0.05 and 0 < server < 0.05  # CPU seconds per exchange: some, and far under 50 ms
