"""Runs batches on one device: validate items, stack them, one forward pass, split the outputs back.

Ownership and threading: one Executor per device. Three steps: `check_item` validates one item and says
which padded shape it stacks under (the runner uses that to merge batches); `prepare` (or
`prepare_checked`, for items already checked) groups, pads to the bucket, concatenates and starts the
host→device copy (pinned buffers, non-blocking, on a dedicated copy stream under CUDA); `execute` waits
for that copy, runs the forwards and copies outputs back; every forward (bisection and canary included)
runs in `execute`. `prepare` and `execute` may run on two threads, one batch each at a time (the runner
runs both on its device thread); `run` is both in sequence and blocks for the whole batch. Invariants:
- every item gets exactly one outcome, in the order given: outputs or a typed error, never both;
- a malformed item (worker/validation.py) fails alone with InvalidArgument, never blamed on the worker;
  the others still run;
- items are stacked along dim 0 only when their padded (bucketed) shapes agree, in forward groups within
  the model's max_batch_size rows and max_batch_cost (common/batching.py; shapes that differ run as
  separate forwards);
- a failed forward is isolated exactly (worker/isolation.py): only items that fail alone fail, with
  Internal and the exception's message;
- blame: items the model failed are the client's, unless the model also fails its canary (the warm-up
  input, which warm-up proved it runs) or the device faulted: then `worker_fault` is set;
- after a fatal device error (worker/faults.py) `fault` is set for good and nothing touches the device
  again: every later item fails at once, blamed on the worker;
- an item's outputs are row slices of its forward's host outputs, never copied per item (the runner packs
  a batch's items into one buffer per output); inputs are never written to (they may be read-only views
  of the wire buffer).
No clock is read here: the shell measures queue and execute time around `execute`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from sluice_inference.common.batching import BatchFill
from sluice_inference.common.errors import Internal, InvalidArgument, SluiceError
from sluice_inference.common.records import ModelRecord
from sluice_inference.common.tensors import DATATYPES
from sluice_inference.worker.backends import Backend, load_backend
from sluice_inference.worker.device_copies import DeviceCopies
from sluice_inference.worker.faults import is_fatal_device_error
from sluice_inference.worker.isolation import isolate
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.padding import ShapeKey, group_key, stack
from sluice_inference.worker.repository import ModelVersionSpec
from sluice_inference.worker.validation import ModelChecks

Array = npt.NDArray[Any]
# Length used for variable dims during warm-up when the input declares no buckets.
WARMUP_VARIABLE_LENGTH = 8


# The per-item records below are built several times per batch: slotted, not frozen, since a frozen
# dataclass costs about three times as much to build. Nothing mutates them once built.
@dataclass(slots=True)
class ExecItem:
    """One request's inputs, each with its own leading batch dim (usually 1 row; k rows are allowed)."""

    item_id: int
    inputs: dict[str, Array]


@dataclass(slots=True)
class ItemOutcome:
    """The result for one item: `outputs` (requested names → arrays) or `error`; `worker_fault` when the
    error is the worker's doing, not the item's (see worker.proto, ItemError.worker_fault)."""

    item_id: int
    outputs: dict[str, Array] | None
    error: SluiceError | None
    worker_fault: bool = False


@dataclass(frozen=True)
class LoadedModel:
    """A model version loaded on this executor's device."""

    spec: ModelVersionSpec
    backend: Backend

    @functools.cached_property
    def checks(self) -> ModelChecks:
        """This version's input and output checks, resolved from its config once (not per batch)."""
        return ModelChecks(self.spec.config)

    @property
    def record(self) -> ModelRecord:
        """What the worker publishes for this version."""
        return self.spec.record()


@dataclass(slots=True)
class CheckedItem:
    """An item after validation: its rows and the padded shape it stacks under, or the InvalidArgument
    that keeps it out of every forward (it then fails alone)."""

    item: ExecItem
    rows: int = 0
    shape: ShapeKey | None = None
    error: InvalidArgument | None = None


def check_item(model: LoadedModel, item: ExecItem) -> CheckedItem:
    """Validate `item` against `model`'s config (worker/validation.py) and find its padded shape."""
    try:
        rows = model.checks.item_rows(item.inputs)
    except InvalidArgument as exc:
        return CheckedItem(item, error=exc)
    return CheckedItem(item, rows, group_key(model.spec.config, item.inputs))


def check_items(
    model: LoadedModel, items: Sequence[ExecItem], rows: Sequence[int], whole: Mapping[str, Array] | None
) -> list[CheckedItem]:
    """`check_item` for each item, with the checks run once when they can be: when the items' inputs are
    consecutive row ranges (`rows` each) of `whole` (one array per input, every item with the same row
    dims), what holds for the whole holds for every range of it — names, datatypes, dims, bucket bounds,
    declared ranges — so one pass decides for all, and only a whole that fails is checked item by item
    to find the items at fault (they fail alone)."""
    if whole is not None and items and min(rows) >= 1:
        try:
            model.checks.item_rows(whole)  # also holds the whole to max_batch_size rows, so each item too
        except InvalidArgument:
            pass  # some item is at fault: the checks below name it
        else:
            shape = group_key(model.spec.config, whole)
            return [CheckedItem(item, count, shape) for item, count in zip(items, rows, strict=True)]
    return [check_item(model, item) for item in items]


@dataclass(slots=True)
class _Planned:
    """A validated item: its position in the batch, its row count and padded shape."""

    index: int
    item: ExecItem
    rows: int
    shape: ShapeKey = ()


@dataclass
class _Staged:
    """One forward's items with their inputs already on (or on the way to) the device."""

    group: list[_Planned]
    rows: int
    tensors: dict[str, torch.Tensor] | None
    error: Internal | None = None


@dataclass
class PreparedBatch:
    """A batch after `prepare`: outcomes of items that failed validation, and the staged forwards."""

    model: LoadedModel
    size: int
    requested: list[str]
    outcomes: dict[int, ItemOutcome]
    forwards: list[_Staged]
    copied: Any = None  # a torch.cuda.Event recorded on the copy stream, under CUDA

    @property
    def forward_rows(self) -> int:
        """Rows that go into forwards (items that failed validation excluded)."""
        return sum(staged.rows for staged in self.forwards)


class Executor:
    """Executes batches for the models loaded on one device, one batch at a time."""

    def __init__(self, device: str = "cpu", torch_threads: int = 1) -> None:
        self.device = torch.device(device)
        # Intra-op threads: 1 by default, since several workers share small machines and more threads
        # make latency swing wildly under contention (DEPENDENCIES.md, PyTorch).
        torch.set_num_threads(torch_threads)
        self._copies = DeviceCopies(self.device)
        self._copy_stream = self._copies.stream
        self._fault: Internal | None = None

    @property
    def fault(self) -> Internal | None:
        """The fatal device error this executor met, if any: from then on its device is never used again
        and the process must be replaced (worker/faults.py)."""
        return self._fault

    def load(self, spec: ModelVersionSpec) -> LoadedModel:
        """Load `spec` onto this executor's device (not yet warmed up)."""
        return LoadedModel(spec=spec, backend=load_backend(spec, str(self.device)))

    def run(
        self, model: LoadedModel, items: Sequence[ExecItem], outputs: Sequence[str] = ()
    ) -> list[ItemOutcome]:
        """Execute `items` as one batch (or a few forwards when shapes differ); one outcome per item."""
        return self.execute(self.prepare(model, items, outputs))

    def prepare(
        self, model: LoadedModel, items: Sequence[ExecItem], outputs: Sequence[str] = ()
    ) -> PreparedBatch:
        """Validate, group and stage inputs on the device (asynchronously under CUDA)."""
        return self.prepare_checked(model, [check_item(model, item) for item in items], outputs)

    def prepare_checked(
        self, model: LoadedModel, items: Sequence[CheckedItem], outputs: Sequence[str] = ()
    ) -> PreparedBatch:
        """`prepare` for items `check_item` already validated against this model: group and stage them.
        Items may come from several batches (the runner's merge): outcomes follow the order given."""
        config = model.spec.config
        declared = model.checks.output_names
        requested = list(dict.fromkeys(outputs)) if outputs else list(declared)
        prepared = PreparedBatch(model, len(items), requested, {}, [])
        unknown = [name for name in outputs if name not in declared]
        if unknown:
            error = InvalidArgument(
                f"model {config.name!r} has no output(s) {unknown} (outputs: {list(declared)})",
                reason="unknown_output",
            )
            prepared.outcomes = {
                i: ItemOutcome(checked.item.item_id, None, error) for i, checked in enumerate(items)
            }
            return prepared
        valid: list[_Planned] = []
        for index, checked in enumerate(items):
            if checked.error is not None or checked.shape is None:
                error = checked.error or InvalidArgument("item was not validated", reason="bad_input")
                prepared.outcomes[index] = ItemOutcome(checked.item.item_id, None, error)
            else:
                valid.append(_Planned(index, checked.item, checked.rows, checked.shape))
        prepared.forwards = [self._stage(model, group) for group in _forward_groups(config, valid)]
        if self._copy_stream is not None:
            prepared.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            prepared.copied.record(self._copy_stream)
        return prepared

    def execute(self, prepared: PreparedBatch) -> list[ItemOutcome]:
        """Run the staged forwards and split their outputs; one outcome per item, in input order.

        A forward that fails as a whole is isolated exactly (worker/isolation.py: halves re-run until each
        failing item failed alone; at most 2·n - 2 extra forwards for n items). Then blame (`_blame`).
        """
        if prepared.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(prepared.copied)
        model, requested = prepared.model, prepared.requested
        first: list[ItemOutcome] | None = None
        if len(prepared.forwards) == 1 and not prepared.outcomes:
            # The usual batch: one forward of every item, in input order. If it passed (or met a device
            # fault, already blamed on the worker) there is nothing to isolate or blame.
            first = self._forward(model, prepared.forwards[0], requested)
            if not _suspect(first):
                return first
        outcomes = dict(prepared.outcomes)
        rerun = functools.partial(self._stage_and_forward, model, requested)
        forwarded: list[int] = []
        for staged in prepared.forwards:
            if first is None:
                first = self._forward(model, staged, requested)
            isolated = isolate(staged.group, first, rerun, _suspect)
            for planned, outcome in zip(staged.group, isolated, strict=True):
                outcomes[planned.index] = outcome
                forwarded.append(planned.index)
            first = None
        self._blame(model, outcomes, forwarded)
        return [outcomes[index] for index in range(prepared.size)]

    def _blame(self, model: LoadedModel, outcomes: dict[int, ItemOutcome], forwarded: list[int]) -> None:
        """Mark the forwarded items the model failed as the worker's fault when the worker is to blame.

        Evidence, cheapest first: a device fault blames the worker (CUDA reports errors late and for the
        whole context, so no item can be singled out); else an item that succeeded proves the device and
        model work, so the failures are the items' own; else (every item failed, even alone) one canary
        forward of the warm-up input decides: it passes → the items are at fault (a client sending only
        bad items must not take the worker out of rotation); it fails → the model or device is broken.
        """
        failed = [i for i in forwarded if outcomes[i].error is not None and not outcomes[i].worker_fault]
        if not failed:
            return
        some_passed = any(outcomes[i].error is None for i in forwarded)
        if self._fault is None and (some_passed or self._canary(model)):
            return
        cause = self._fault.message if self._fault else "the model also fails its warm-up input"
        for index in failed:
            outcomes[index] = _blamed_on_worker(outcomes[index], cause)

    def _canary(self, model: LoadedModel) -> bool:
        """Forward one row of the warm-up input (known good: warm-up ran it); whether it still passes,
        every declared output checked as warm-up checked it."""
        config = model.spec.config
        item = warmup_items(config, 1)[0]
        outputs = [t.name for t in config.outputs]
        [outcome] = self._stage_and_forward(model, outputs, [_Planned(-1, item, 1)])
        return outcome.error is None

    def warm_up(self, model: LoadedModel) -> None:
        """Run every warm-up batch size in every shape bucket once with zeros; raises Internal if any fails
        (the model is not ready: a bucket that was never run could still compile or allocate on first use)."""
        config = model.spec.config
        for length in warmup_lengths(config):
            for size in config.warmup_sizes:
                for outcome in self.run(model, warmup_items(config, size, length)):
                    if outcome.error is not None:
                        raise Internal(
                            f"warm-up of {config.name!r} v{model.spec.version} at batch {size}, "
                            f"length {length} failed: {outcome.error.message}",
                            reason="warmup_failed",
                        )

    def _stage_and_forward(
        self, model: LoadedModel, requested: list[str], group: Sequence[_Planned]
    ) -> list[ItemOutcome]:
        """Stage and forward `group` now, from `execute` (bisection, canary)."""
        staged = self._stage(model, list(group))
        if self._copy_stream is not None:
            # The copy ran on the copy stream: the forward on the compute stream must wait for it.
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        return self._forward(model, staged, requested)

    def _stage(self, model: LoadedModel, group: list[_Planned]) -> _Staged:
        config = model.spec.config
        rows = sum(p.rows for p in group)
        try:
            arrays, mask = stack(config, [p.item.inputs for p in group])
            tensors = {name: self._to_device(array) for name, array in arrays.items()}
            if mask is not None and config.batching.mask_input is not None:
                tensors[config.batching.mask_input] = self._to_device(mask)
        except (RuntimeError, ValueError, MemoryError) as exc:
            return _Staged(group, rows, None, _model_error(model, rows, exc))
        return _Staged(group, rows, tensors)

    def _forward(self, model: LoadedModel, staged: _Staged, requested: list[str]) -> list[ItemOutcome]:
        group, rows = staged.group, staged.rows
        if self._fault is not None:
            return [ItemOutcome(p.item.item_id, None, self._fault, worker_fault=True) for p in group]
        try:
            if staged.tensors is None:
                raise staged.error or RuntimeError("inputs were not staged")
            with torch.inference_mode():
                produced = model.backend.forward(staged.tensors)
            arrays = self._to_host({name: _output(produced, name) for name in requested})
            model.checks.outputs(arrays, rows)
        except Exception as exc:
            # The model's own code may raise anything; it concerns this forward's items only, and the
            # message travels to the client (the shell logs the traceback from __cause__) -- unless the
            # device itself is broken, which concerns everything from now on.
            if is_fatal_device_error(exc):
                self._fault = _device_fault(model, self.device, exc)
                return [ItemOutcome(p.item.item_id, None, self._fault, worker_fault=True) for p in group]
            error = exc if isinstance(exc, Internal) else _model_error(model, rows, exc)
            return [ItemOutcome(p.item.item_id, None, error) for p in group]
        outcomes = []
        start = 0
        for planned in group:
            stop = start + planned.rows
            outputs = {name: array[start:stop] for name, array in arrays.items()}
            outcomes.append(ItemOutcome(planned.item.item_id, outputs, None))
            start = stop
        return outcomes

    def _to_device(self, array: Array) -> torch.Tensor:
        return self._copies.to_device(array)

    def _to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, Array]:
        return self._copies.to_host(tensors)


def _model_error(model: LoadedModel, rows: int, exc: BaseException) -> Internal:
    error = Internal(
        f"model {model.spec.config.name!r} v{model.spec.version} failed on a batch of {rows} rows: "
        f"{type(exc).__name__}: {exc}",
        reason="model_error",
    )
    error.__cause__ = exc
    return error


def _device_fault(model: LoadedModel, device: torch.device, exc: BaseException) -> Internal:
    error = Internal(
        f"device {device} failed running {model.spec.config.name!r} v{model.spec.version} and cannot be "
        f"used again; the worker is restarting: {type(exc).__name__}: {exc}",
        reason="device_fault",
    )
    error.__cause__ = exc
    return error


def _blamed_on_worker(outcome: ItemOutcome, cause: str) -> ItemOutcome:
    assert outcome.error is not None
    error = Internal(f"{outcome.error.message} (the worker is at fault: {cause})", reason="worker_fault")
    error.__cause__ = outcome.error.__cause__
    return replace(outcome, error=error, worker_fault=True)


def _suspect(outcomes: list[ItemOutcome]) -> bool:
    """A forward worth halving: it failed, and not because the device is gone (that repeats anyway)."""
    return outcomes[0].error is not None and not outcomes[0].worker_fault


def _output(produced: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in produced:
        raise KeyError(f"backend returned no output {name!r} (got {sorted(produced)})")
    return produced[name]


def _forward_groups(config: ModelConfig, valid: list[_Planned]) -> list[list[_Planned]]:
    """Items of equal padded (bucketed) shape, in arrival order, cut into forwards by the batching rule
    (common/batching.py): a new forward whenever the next item would take its shape's current one past
    the model's max_batch_size rows or max_batch_cost."""
    if len(valid) <= 1:  # the first item of a forward always fits
        return [valid] if valid else []
    first = valid[0]
    if all(planned.shape == first.shape for planned in valid):
        # One shape (the usual batch): item by item, every item fits iff all of them fit (the totals only
        # grow), so the rule is asked once for the first item and once for the rest together.
        row_cost = config.row_cost_of(first.shape)
        rest = sum(planned.rows for planned in valid) - first.rows
        fill = BatchFill(config.batch_limits)
        fill.take(first.rows, first.rows * row_cost)
        if fill.take(rest, rest * row_cost):
            return [valid]
    by_shape: dict[ShapeKey, tuple[int, list[tuple[BatchFill, list[_Planned]]]]] = {}
    limits = config.batch_limits
    for planned in valid:
        known = by_shape.get(planned.shape)
        if known is None:
            known = by_shape[planned.shape] = (config.row_cost_of(planned.shape), [])
        row_cost, groups = known
        if not groups or not groups[-1][0].take(planned.rows, planned.rows * row_cost):
            fill = BatchFill(limits)
            fill.take(planned.rows, planned.rows * row_cost)
            groups.append((fill, []))
        groups[-1][1].append(planned)
    return [group for _, groups in by_shape.values() for _, group in groups]


def warmup_lengths(config: ModelConfig) -> list[int]:
    """The variable-dim lengths warm-up must cover: every declared bucket (or one default length)."""
    buckets = sorted({size for sizes in config.batching.buckets.values() for size in sizes})
    return buckets or [WARMUP_VARIABLE_LENGTH]


def warmup_items(config: ModelConfig, size: int, length: int | None = None) -> list[ExecItem]:
    """`size` one-row items of zeros, the inputs warm-up runs (and times) for a batch of `size`; one of
    them is also the canary that tells a broken model from bad items."""
    return [ExecItem(i, _warmup_row(config, length or warmup_lengths(config)[0])) for i in range(size)]


def _warmup_row(config: ModelConfig, length: int) -> dict[str, Array]:
    """One row per input, of zeros (or the declared range's bound nearest zero); variable dims get
    `length`."""
    inputs = {}
    for spec in config.inputs:
        shape = [1, *(length if d == -1 else d for d in spec.dims)]
        value = 0 if spec.range is None else min(max(0, spec.range[0]), spec.range[1])
        inputs[spec.name] = np.full(shape, value, dtype=DATATYPES[spec.datatype])
    return inputs
