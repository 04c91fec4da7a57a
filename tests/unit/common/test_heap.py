"""The server processes' collector settings (common/heap.py), checked in a fresh interpreter: freezing the
test process's own heap would leak every later test's cyclic garbage that was alive at that moment."""

from __future__ import annotations

import json
import subprocess
import sys

from sluice_inference.common.heap import YOUNG_THRESHOLD

PROBE = """
import gc, json, weakref
from sluice_inference.common.heap import settle_after_startup

class Node:
    pass

kept = [Node() for _ in range(5000)]      # what start-up holds for good
settle_after_startup()
frozen = gc.get_freeze_count()
later = Node(); later.me = later          # cyclic garbage made after start-up
gone = weakref.ref(later)
del later
gc.collect()
print(json.dumps({"frozen": frozen, "threshold": gc.get_threshold(), "collected": gone() is None,
                  "enabled": gc.isenabled(), "kept": len(kept)}))
"""


def test_start_up_objects_are_frozen_and_later_cycles_are_still_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    state = json.loads(done.stdout)
    assert state["frozen"] >= 5000  # start-up's objects left the collector's view
    assert state["threshold"][0] == YOUNG_THRESHOLD
    assert state["enabled"]
    assert state["collected"]  # the collector still finds garbage made after start-up
