"""The collector settings of common/heap.py. A server process's and a frozen block's are checked in a fresh
interpreter: freezing the test process's own heap would leak every later test's cyclic garbage that was
alive at that moment."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from sluice_inference.common.heap import YOUNG_THRESHOLD, young_collections_every

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


BLOCKS = """
import gc, json, weakref
from sluice_inference.common.heap import frozen_heap

class Node:
    pass

before = Node(); before.me = before        # cyclic garbage from before the block
gone_before = weakref.ref(before)
del before
seen = {}
with frozen_heap():
    seen["outer"] = gc.get_freeze_count()
    with frozen_heap():
        inner = Node(); inner.me = inner   # garbage made inside: the collector still finds it
        gone_inner = weakref.ref(inner)
        del inner
        gc.collect()
        seen["inner_collected"] = gone_inner() is None
    seen["after_inner"] = gc.get_freeze_count()
    gc.collect()
    seen["before_kept_in_block"] = gone_before() is not None
seen["after_outer"] = gc.get_freeze_count()
gc.collect()
seen["before_collected_after"] = gone_before() is None
print(json.dumps(seen))
"""


def test_a_frozen_block_hides_the_heap_from_the_collector_until_the_outermost_block_ends() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKS], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(done.stdout)
    assert seen["outer"] > 0
    assert seen["inner_collected"]  # what the block makes is still collected
    assert seen["after_inner"] >= seen["outer"]  # an inner block's end leaves the outer's heap frozen
    assert seen["before_kept_in_block"]  # garbage from before waits, frozen, while the block runs
    assert seen["after_outer"] == 0
    assert seen["before_collected_after"]  # and is collected once the heap is given back


def test_young_collections_are_spaced_for_a_block_and_the_thresholds_come_back() -> None:
    before = gc.get_threshold()
    with young_collections_every(123_456):
        inside = gc.get_threshold()
    assert inside == (123_456, *before[1:])  # the older generations keep their counts
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), young_collections_every(50_000):
        raise RuntimeError("the block failed")
    assert gc.get_threshold() == before  # given back whatever happens in the block
    with pytest.raises(ValueError, match="at least 1"), young_collections_every(0):
        pass
