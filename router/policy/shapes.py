"""Which lane shapes the router keeps state for: at most `MAX_SHAPES_PER_MODEL` per model, the least
recently used idle one forgotten first.

A lane shape (`LaneKey.shape`) is each input's non-batch shape after bucketing (common/buckets.py). A
variable dim with configured buckets takes one value per bucket, and a length past the largest bucket is
refused when the request is decoded; a variable dim without buckets keeps its exact length, as in Triton,
so only identical shapes batch together — and a client picks how many lengths there are (`[1, 3, 0, k]`
holds no element, so every k costs it nothing to send). Per shape the core keeps a lane, its limits, its
last decision to wait, its arrival and latency statistics, and execution-time fits (across workers and
per worker); this table is what bounds them all.

Rules:
- a shape is *used* each time a request of it is admitted;
- a shape is *busy* while its lane holds requests or a batch of it is on a worker; a busy shape is never
  forgotten, so its requests' lane and the estimates their batches were sent on stay;
- a model's new shape beyond the limit takes the place of its least recently used idle shape, whose state
  the core then drops (if the shape comes back it starts afresh: its estimates fall back to the model
  version's fit); when every one of the model's shapes is busy, the newcomer is refused (the core answers
  UNAVAILABLE `too_many_shapes`).
Invariant: a model has at most `limit` shapes here, and the core holds per-shape state only for shapes
here. Model names come from workers' registrations, never from clients.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from sluice_inference.router.policy.lanes import LaneKey

MAX_SHAPES_PER_MODEL: Final = 256
"""Lane shapes with state per model, across its versions. A model with bucketed variable dims has a few;
traffic with more distinct exact shapes than this batches poorly anyway (configure buckets)."""


class ShapeTable:
    """The lane shapes of each model that hold state, least recently used first."""

    def __init__(self, limit: int = MAX_SHAPES_PER_MODEL) -> None:
        if limit < 1:
            raise ValueError("a model needs room for at least one shape")
        self.limit = limit
        self._models: dict[str, OrderedDict[LaneKey, None]] = {}

    def use(self, key: LaneKey, busy: Callable[[LaneKey], bool]) -> list[LaneKey] | None:
        """Mark `key` as just used. Returns the shapes whose state must be dropped to make room for it
        (empty when it was known or there is room), or None when the model has no room: every one of
        its shapes is `busy`, and `key` must be refused."""
        shapes = self._models.get(key.model)
        if shapes is None:
            shapes = self._models[key.model] = OrderedDict()
        else:
            try:  # a known shape (nearly every request): one lookup of its key, not two
                shapes.move_to_end(key)
                return []
            except KeyError:
                pass
        forgotten: list[LaneKey] = []
        if len(shapes) >= self.limit:
            idle = next((known for known in shapes if not busy(known)), None)
            if idle is None:
                return None
            del shapes[idle]
            forgotten.append(idle)
        shapes[key] = None
        return forgotten

    def __len__(self) -> int:
        return sum(len(shapes) for shapes in self._models.values())

    def __contains__(self, key: LaneKey) -> bool:
        return key in self._models.get(key.model, ())
