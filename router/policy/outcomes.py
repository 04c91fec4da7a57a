"""What flows in and out of the router core besides requests: answers from workers, and decisions.

Every event the core takes returns one `Decision`; the shell (the asyncio driver, or the simulator) carries
it out and does nothing else: send the dispatches, end the settled requests, tell workers to drop items,
disconnect lost workers, and call `tick` again at `wake_at` at the latest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from sluice_inference.common.errors import SluiceError
from sluice_inference.router.policy.lanes import LaneKey, QueuedRequest, ShellData


@dataclass(slots=True)
class ItemAnswer:
    """A worker's outcome for one item (keyed by the item's id in `BatchAnswer.items`): `code` 0 with
    `outputs`, or an error. (A slotted class, like the other records made once per request: a
    NamedTuple's `__new__` is a Python call and costs half as much again, a frozen dataclass several times
    as much; nothing changes one once built, so equal outcomes may share one.)"""

    code: int = 0
    message: str = ""
    worker_fault: bool = False
    """The worker blames itself (a device fault, a model that fails its canary): counts against it."""
    reason: str = ""
    """Machine-readable cause from the worker, e.g. `worker_busy` (place the batch elsewhere)."""
    outputs: ShellData = None
    """The shell's tensors, never inspected by the core."""


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """A worker's answer to one batch."""

    batch_id: int
    items: dict[int, ItemAnswer]
    executed_rows: int
    """Rows of the forward the batch ran in, batches the worker merged with it included (0: nothing ran):
    what `execute_s` bought, so what the latency fits learn from."""
    execute_s: float
    """The worker's forward time."""
    queued_batches: int | None = None
    """Batches the worker still held (all routers) when it answered; None when it did not say."""


class Dispatch(NamedTuple):
    """A batch cut from a lane and assigned to a worker (a tuple: immutable, and one is built per batch at
    a third of a frozen dataclass's cost)."""

    batch_id: int
    worker_id: str
    lane: LaneKey
    requests: tuple[QueuedRequest, ...]
    reason: str
    expected_s: float
    """Estimated execution time on its worker when it was sent."""
    sent_at: float
    rows: int
    """Batch-dimension rows in the batch."""


@dataclass(slots=True)
class Served:
    """A successful outcome: the worker's outputs and how the request was served (one per request: not
    frozen, as `ItemAnswer`)."""

    worker_id: str
    batch_rows: int
    queue_s: float
    """From arrival until its batch was sent."""
    outputs: ShellData

    def __init__(self, worker_id: str, batch_rows: int, queue_s: float, outputs: ShellData) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.worker_id = worker_id
        self.batch_rows = batch_rows
        self.queue_s = queue_s
        self.outputs = outputs


@dataclass(slots=True)
class Settled:
    """A request that has ended, with its result or typed error. Every request ends exactly once (one per
    request: not frozen, as `ItemAnswer`)."""

    request: QueuedRequest
    outcome: Served | SluiceError

    def __init__(self, request: QueuedRequest, outcome: Served | SluiceError) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.request = request
        self.outcome = outcome


class Learned(NamedTuple):
    """A batch whose time taught the estimates: what was predicted, and what the core measured (a tuple:
    one per batch)."""

    dispatch: Dispatch
    seconds: float
    execute_s: float


@dataclass(slots=True, init=False)
class Decision:
    """What the shell must do now, and when to call `tick` again at the latest (an empty one to start
    with)."""

    dispatches: list[Dispatch]
    settled: list[Settled]
    drops: dict[str, list[int]]
    """Items each worker should skip (ended here: deadline passed, or the client went away)."""
    lost: list[str]
    """Workers found hung (holding work, no progress): disconnect them."""
    learned: list[Learned]
    wake_at: float | None
    """A tick's `wake_at` is everything the core waits for; another event's only adds what that event
    changed (an arrival: its lane), so a shell keeps the earlier of that and the time it already had."""

    def __init__(self) -> None:
        # Literals rather than `default_factory`: one decision is built per event, and five factory calls
        # cost as much again as the rest of it.
        self.dispatches = []
        self.settled = []
        self.drops = {}
        self.lost = []
        self.learned = []
        self.wake_at = None

    def settle(self, request: QueuedRequest, outcome: Served | SluiceError) -> None:
        """Record that `request` ended."""
        self.settled.append(Settled(request, outcome))

    def drop(self, worker_id: str, item_id: int) -> None:
        """Tell `worker_id` to skip `item_id`."""
        self.drops.setdefault(worker_id, []).append(item_id)

    def wake(self, when: float | None) -> None:
        """Ask to be ticked no later than `when`."""
        if when is not None and (self.wake_at is None or when < self.wake_at):
            self.wake_at = when
