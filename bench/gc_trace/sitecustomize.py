"""What the garbage collector costs a running router or worker: put this folder on `PYTHONPATH` and set
`SLUICE_GC_TRACE` to a folder, and every Sluice router and worker process started with that environment
writes `<role>-<pid>.json` there every two seconds and when it exits: per generation, the collections,
the CPU seconds they took (the collecting thread's, start to stop) and the longest one
(docs/performance.md, "The sitting of 2026-12-02").

    PYTHONPATH=bench/gc_trace SLUICE_GC_TRACE=/tmp/gc RESULTS_DIR=/tmp/gc/res \\
        ../shared/peers/sweep.sh sluice 600

Python imports `sitecustomize` at start-up from the path, before the program runs, which is how this
reaches the children `sluice up` starts. Counts start `SLUICE_GC_TRACE_AFTER_S` (default 6) after the
process did, past start-up. Not part of Sluice's own code paths: a measuring aid only.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from typing import Any


def _role(argv: list[str]) -> str | None:
    """Which Sluice process this is, from its command line (None: not one to trace)."""
    if "router" in argv and "--listen" in argv:
        return "router"
    if "worker" in argv and "--repository" in argv:
        return "worker"
    return None


def _trace(folder: str, role: str, after_s: float) -> None:
    started = time.monotonic()
    stats = {generation: {"collections": 0, "cpu_s": 0.0, "longest_s": 0.0} for generation in range(3)}
    began = [0.0]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.thread_time()
            return
        if time.monotonic() - started < after_s:
            return
        took = time.thread_time() - began[0]
        entry = stats[info["generation"]]
        entry["collections"] += 1
        entry["cpu_s"] += took
        entry["longest_s"] = max(entry["longest_s"], took)

    path = os.path.join(folder, f"{role}-{os.getpid()}.json")

    def write() -> None:
        """The figures so far, replacing the file whole (the periodic writer and the exit may overlap)."""
        state = {"generations": stats, "threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
        partial = f"{path}.{threading.get_ident()}.tmp"
        with open(partial, "w", encoding="utf-8") as out:
            json.dump(state, out)
        os.replace(partial, path)

    def write_every_two_seconds() -> None:
        while True:
            time.sleep(2.0)
            write()

    gc.callbacks.append(on_collection)
    atexit.register(write)  # a process that exits normally leaves its final figures
    threading.Thread(target=write_every_two_seconds, name="gc-trace", daemon=True).start()


_folder = os.environ.get("SLUICE_GC_TRACE")
_this = _role(sys.argv)
if _folder and _this is not None:
    _trace(_folder, _this, float(os.environ.get("SLUICE_GC_TRACE_AFTER_S", "6")))
