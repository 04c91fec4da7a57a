"""Simulator scenarios: the YAML schema (pydantic) and its variants, loaded and validated with the key named.

A scenario names the model's latency profile, the worker fleet (groups of workers with a relative speed),
the traffic (rate or load, arrival process, classes), noise and failures, the policy under test, and the
variants to compare. docs/batching.md shows the format; every field below carries its meaning.

Rules:
- a scenario is data only; `sluice_inference.bench.sim.plan` turns it (and a variant)
  into the arrivals of one run;
- `load` is a multiple of the fleet's capacity (`capacity_rps`): full batches on every worker, each class
  in its own lane, at its share of the mix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice_inference.bench.loadgen_scenario import Arrivals, ScenarioError
from sluice_inference.common.batching import BatchLimits

MAX_ARRIVALS = 5_000_000
"""Arrival times are precomputed; more would take a lot of memory for no better figure."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The simulated model: its latency profile on a speed-1 worker and its batching limits."""

    name: str = "synthetic"
    """Model name (lanes are keyed by it)."""
    version: str = "1"
    """Resolved version."""
    base_ms: float = Field(default=5.0, ge=0)
    """Fixed cost a of one batch: t(b) = a + c·b."""
    per_item_ms: float = Field(default=0.5, ge=0)
    """Per-row cost c of one batch (for a class with item_cost 1)."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most rows per batch (the lane's limit)."""
    max_wait_ms: float = Field(default=2.0, ge=0)
    """The lane's max wait (the timer batcher's timeout; a bound for the adaptive one too)."""
    max_batch_cost: int | None = Field(default=None, ge=1)
    """Most rows x padded length per batch (`batching.max_batch_cost`, enforced by the core's lanes): a
    lane of long inputs gets fewer rows per batch, so its batches occupy a worker no longer than a full
    short one."""

    def lane_rows(self, length: int) -> int:
        """Most rows of one-row requests a batch of this (padded) length holds (for capacity figures)."""
        return BatchLimits(self.max_batch_size, self.max_batch_cost).most_rows(length)

    def batch_seconds(self, rows: int, item_cost: float = 1.0) -> float:
        """t(rows) on a speed-1 worker, without noise."""
        return (self.base_ms + self.per_item_ms * item_cost * rows) / 1000.0


class SimClass(_Strict):
    """One kind of request in the mix."""

    name: str = Field(min_length=1)
    """Label in the report (unique)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of arrivals, relative to the other classes."""
    tenant: str = "default"
    """Tenant: unlimited, unless the scenario's `quotas` name it."""
    priority: int = Field(default=1, ge=1)
    """1 is the highest."""
    deadline_ms: float = Field(gt=0)
    """The client's deadline; OK later than this is not good."""
    rows: int = Field(default=1, ge=1)
    """Rows per request."""
    length: int = Field(default=16, ge=1)
    """Input length: classes with different lengths are different lanes (shape buckets)."""
    item_cost: float = Field(default=1.0, gt=0)
    """Per-row cost relative to the model's per_item_ms (a long input costs more)."""
    placement: list[int] | None = Field(default=None, min_length=1)
    """Routers (indices from 0) this class's requests land on, in turn — a client holding one long-lived
    channel sticks to one router; unset: every router in turn."""


class Quota(_Strict):
    """A tenant's cluster-wide quota (`tenants.<name>` in sluice.yaml), split across the routers."""

    rate: float = Field(gt=0)
    """Requests per second."""
    burst: int = Field(default=100, ge=1)
    """Bucket size."""
    max_inflight: int = Field(default=1_000_000, ge=1)
    """Requests admitted and not yet answered."""


class WorkerGroup(_Strict):
    """Identical workers."""

    name: str = "w"
    """Worker ids are this prefix plus an index."""
    count: int = Field(default=1, ge=1, le=100_000)
    """How many."""
    speed: float = Field(default=1.0, gt=0)
    """Relative speed: batch times are divided by it (0.5 = twice slower)."""
    capacity: int = Field(default=2, ge=1)
    """Batches each worker holds at once from all routers together (its registration's `capacity`);
    one router alone keeps at most `router.batches_in_flight_per_worker` on it (2: a simulated worker
    registers as an accelerator)."""


class Noise(_Strict):
    """How real batch times stray from the profile."""

    sigma: float = Field(default=0.0, ge=0, le=2)
    """Sigma of a lognormal factor with mean 1 on every batch time."""
    stall_p: float = Field(default=0.0, ge=0, le=1)
    """Probability that a batch stalls."""
    stall_ms: float = Field(default=0.0, ge=0)
    """How long a stall adds."""


class Failure(_Strict):
    """A worker event at a given time."""

    worker: str
    """Worker id (e.g. w0)."""
    at_s: float = Field(ge=0)
    """Virtual time of the event."""
    kind: Literal["crash", "drain"] = "crash"
    """crash: the worker and its batches vanish; drain: it takes no new batches and leaves when done."""
    detect_ms: float = Field(default=0.0, ge=0)
    """crash only: delay before the router notices (0: socket closed at once; ~1000 for a hung host)."""


class Policy(_Strict):
    """The router policies under test."""

    batcher: Literal["adaptive", "timer"] = "adaptive"
    """When to cut a batch."""
    scheduler: Literal["expected_completion", "least_loaded", "round_robin"] = "expected_completion"
    """Which worker gets it."""
    admission: bool = True
    """Quotas, deadline budgets and bounded lanes (False: the unbounded FIFO baseline)."""
    lane_max_queued: int = Field(default=1000, ge=1)
    """Admission's per-lane bound."""
    padded: bool = False
    """Baseline without shape buckets: every class joins one lane padded to the longest input."""
    quota_shares: Literal["demand", "equal"] = "demand"
    """How routers split the `quotas` (`admission.quota_shares`): following demand, or 1/N each."""


class Variant(_Strict):
    """A named change to the scenario, for comparisons."""

    name: str = Field(min_length=1)
    """Label in tables and plots."""
    policy: dict[str, Any] = {}
    """Policy fields to override."""
    drop_classes: list[str] = []
    """Classes whose arrivals are removed from the same schedule."""
    model: dict[str, Any] = {}
    """Model fields to override (e.g. max_batch_cost); load multiples stay those of the base scenario."""


class SimScenario(_Strict):
    """A simulator scenario."""

    description: str = ""
    """What it shows."""
    duration_s: float = Field(gt=0, le=86_400)
    """Seconds over which arrivals are scheduled."""
    rate: float | None = Field(default=None, gt=0)
    """Mean arrivals per second, all classes together."""
    load: float | None = Field(default=None, gt=0)
    """Offered load as a multiple of the fleet's capacity (instead of `rate`)."""
    arrivals: Arrivals = Arrivals()
    """Poisson, or gamma with a CV."""
    seed: int = 0
    """Seeds arrivals, class picks, noise and the scheduler's sampling."""
    overhead_ms: float = Field(default=0.0, ge=0)
    """Constant per-request network and shell time outside the policy core (calibrated against a real
    cluster): it is added to every latency and taken off the budget the router sees."""
    batch_overhead_ms: float = Field(default=0.0, ge=0)
    """Constant per-batch worker time beyond the profile (host work around the forward, timer overshoot),
    calibrated from a real worker's reported execute times; it keeps the device busy like the forward."""
    model: ModelSpec = ModelSpec()
    """The simulated model."""
    classes: list[SimClass] = Field(min_length=1)
    """The traffic mix."""
    workers: list[WorkerGroup] = Field(default_factory=lambda: [WorkerGroup()], min_length=1)
    """The fleet."""
    noise: Noise = Noise()
    """Batch-time noise and stalls."""
    failures: list[Failure] = []
    """Worker crashes and drains."""
    routers: int = Field(default=1, ge=1, le=100)
    """Routers sharing the workers; arrivals are spread over them in turn (or as each class's
    `placement` says), each runs its own core."""
    quotas: dict[str, Quota] = {}
    """Cluster-wide quotas of the tenants named here; other tenants are unlimited."""
    demand_delay_ms: float = Field(default=5.0, ge=0)
    """How long a router's published demand takes to reach the others (etcd's write and watch)."""
    load_report_ms: float = Field(default=250.0, gt=0)
    """How often every worker reports its load to every router (the real heartbeat interval)."""
    workers_report_load: bool = True
    """False: routers see only their own batches on a worker, as before 2026-11-30 (for comparison)."""
    policy: Policy = Policy()
    """The policy of a plain run."""
    variants: list[Variant] = []
    """What `--compare` and `--sweep` run (default: the batcher x scheduler matrix)."""
    sweep: list[float] = [0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0]
    """Load multiples (of capacity) for `--sweep`."""

    @model_validator(mode="after")
    def _sane(self) -> SimScenario:
        if (self.rate is None) == (self.load is None):
            raise ValueError("give exactly one of rate and load")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("classes: duplicate names")
        known = set(names)
        for variant in self.variants:
            unknown = set(variant.drop_classes) - known
            if unknown:
                raise ValueError(f"variants.{variant.name}: unknown classes {sorted(unknown)}")
            Policy.model_validate({**self.policy.model_dump(), **variant.policy})
            ModelSpec.model_validate({**self.model.model_dump(), **variant.model})
        for c in self.classes:
            if c.placement is not None and not all(0 <= r < self.routers for r in c.placement):
                last = self.routers - 1
                raise ValueError(f"classes.{c.name}.placement: router indices must lie in 0..{last}")
        ids = set(worker_ids(self.workers))
        for failure in self.failures:
            if failure.worker not in ids:
                raise ValueError(f"failures: unknown worker {failure.worker!r}")
        if self.offered_rate * self.duration_s > MAX_ARRIVALS:
            raise ValueError(f"rate * duration_s must be at most {MAX_ARRIVALS} requests")
        return self

    @property
    def capacity_rps(self) -> float:
        """Requests per second the fleet serves at full batches (each class in its own lane)."""
        total = sum(c.weight for c in self.classes)
        model = self.model
        seconds_per_request = sum(
            c.weight / total * c.rows * model.batch_seconds(model.lane_rows(c.length), c.item_cost)
            / model.lane_rows(c.length)
            for c in self.classes
        )  # fmt: skip
        speed = sum(g.count * g.speed for g in self.workers)
        return speed / seconds_per_request

    @property
    def offered_rate(self) -> float:
        """Arrivals per second of a plain run."""
        return self.rate if self.rate is not None else (self.load or 0.0) * self.capacity_rps


def worker_ids(groups: list[WorkerGroup]) -> list[str]:
    """The fleet's worker ids, group by group: prefix + index (zero-padded, so names sort by index)."""
    ids: list[str] = []
    for group in groups:
        width = len(str(group.count - 1))
        ids.extend(f"{group.name}{k:0{width}d}" for k in range(group.count))
    return ids


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'scenario'}: {e['msg']}" for e in exc.errors())


def parse_sim_scenario(data: Any, overrides: dict[str, Any] | None = None) -> SimScenario:
    """A SimScenario from parsed YAML plus top-level overrides (flags win); ScenarioError names the key.

    Overriding `rate` clears `load` and the reverse, so a flag always wins over the file; a `policy`
    override is merged into the file's policy field by field.
    """
    if not isinstance(data, dict):
        raise ScenarioError("a scenario must be a mapping of keys (duration_s, rate or load, classes, ...)")
    given = {k: v for k, v in (overrides or {}).items() if v is not None and v != {}}
    merged = {**data, **given}
    if isinstance(given.get("policy"), dict) and isinstance(data.get("policy"), dict):
        merged["policy"] = {**data["policy"], **given["policy"]}
    if "rate" in given:
        merged.pop("load", None)
    if "load" in given:
        merged.pop("rate", None)
    try:
        return SimScenario.model_validate(merged)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc)) from None


def load_sim_scenario(path: Path, overrides: dict[str, Any] | None = None) -> SimScenario:
    """Read and validate a simulator scenario file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    return parse_sim_scenario(data, overrides)
