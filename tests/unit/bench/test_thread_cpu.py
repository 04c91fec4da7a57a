"""CPU per request by thread from the kernel's scheduler statistics (bench/thread_cpu.py)."""

from __future__ import annotations

import os
import threading
import time

from sluice_inference.bench.thread_cpu import rows, snapshot


def test_each_threads_run_and_wait_are_split_per_request_with_the_main_thread_named() -> None:
    before = {"10": {"10": ("python", 0, 0), "11": ("event_engine", 1_000, 0)}}
    after = {"10": {"10": ("python", 4_000_000, 1_000_000), "11": ("event_engine", 2_001_000, 0)}}
    table = rows(before, after, requests=1_000, names={"10": "router"})
    assert table == [
        ("router", "event loop (main thread)", 4.0, 1.0),
        ("router", "event_engine 11", 2.0, 0.0),
    ]


def test_a_snapshot_sees_this_processs_threads_and_their_running_time() -> None:
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: stop.wait(5), name="waiter")
    spinner.start()
    try:
        pid = str(os.getpid())
        first = snapshot([os.getpid()])[pid]
        spun = time.thread_time() + 0.05
        while time.thread_time() < spun:
            pass
        second = snapshot([os.getpid()])[pid]
    finally:
        stop.set()
        spinner.join(5)
    assert pid in first and len(first) >= 2  # the main thread and the waiter at least
    assert second[pid][1] - first[pid][1] >= 40_000_000  # the main thread ran the 50 ms spin
