"""Cache audits: which hits are re-run, how close a re-run must come, and what a wrong entry costs.

Rule 1 — budget. A hit is audited with probability `cache.audit_fraction`, and only while its tenant's
audit bucket (`audit_rate` per second, `audit_burst`, per tenant on this router) has a token and fewer
than `audit_max_inflight` audits run here. An audit is one execution, plus one calibration run when the
first comparison is not conclusive (rule 2): a tenant's hits can make workers do at most
2 * `audit_rate` executions a second that its own rate limit did not pay for.

Rule 2 — tolerance. Outputs that are byte-identical match. Float outputs may differ: kernels round
differently for a row alone and the same row in a batch (the demo MLP on CPU: up to ~9 float32 epsilon of
the output's magnitude, 1.5e-4 absolute at input scale 1e3). So an output passes when every element is
within `max(audit_tolerance, margin * deviation * magnitude)`, where `magnitude` is the largest absolute
value of the fresh output and `deviation` is this model version's *measured* relative batch-vs-single
deviation (`DeviationBook`), never below the dtype's epsilon. It is measured by the auditor, not assumed:
when a comparison fails, the audited input is run once more inside a batch (its rows repeated), and the
batched rows' deviation from the single run is learned for the version (the largest seen, capped at
`MAX_RELATIVE_DEVIATION`) before the verdict is given. Integer and bool outputs must be identical.

Rule 3 — consequences. A mismatch is charged to the tenant whose hit was audited: the entry is removed,
and after `audit_strikes` mismatches within `audit_ban_s` that tenant's requests to that model bypass the
cache on this router for `audit_ban_s` (`Strikes`). Nothing is disabled for other tenants: one tenant's
inputs cannot switch caching off for everyone.

Pure: every `now` and every random draw is a parameter; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from sluice_inference.common.tensors import dtype_of
from sluice_inference.router.policy.cache_keys import TensorLike
from sluice_inference.router.policy.ratelimit import TokenBucket

MAX_RELATIVE_DEVIATION: Final = 1e-3
"""The largest batch-vs-single deviation (relative to the output's magnitude) a model version may be
credited with: beyond it a model is not batch-invariant enough for its hits to be vouched for."""
MAX_TRACKED: Final = 4096
"""Bound on the tenants, model versions and (tenant, model) pairs each table here remembers."""


@dataclass(frozen=True)
class OutputGap:
    """How far one float output of a fresh run lies from the other: the largest element difference and
    the largest magnitude of the fresh output (finite values)."""

    worst: float
    magnitude: float

    @property
    def relative(self) -> float:
        """`worst` relative to `magnitude` (inf when the fresh output is all zero and they differ)."""
        if self.worst == 0:
            return 0.0
        return self.worst / self.magnitude if self.magnitude > 0 else math.inf


@dataclass(frozen=True)
class Difference:
    """How a cached result differs from a fresh run. `comparable` is False when they differ in anything
    but float values (names, datatypes, shapes, integer values, where NaNs are)."""

    comparable: bool
    gaps: tuple[OutputGap, ...] = ()
    epsilon: float = 0.0
    """The largest machine epsilon among the differing outputs' dtypes."""

    @property
    def exact(self) -> bool:
        """Byte for byte the same."""
        return self.comparable and all(g.worst == 0 for g in self.gaps)

    @property
    def relative(self) -> float:
        """The largest relative gap (inf when not comparable)."""
        if not self.comparable:
            return math.inf
        return max((g.relative for g in self.gaps), default=0.0)

    def within(self, relative_limit: float, absolute_floor: float) -> bool:
        """Whether every output is within `max(absolute_floor, relative_limit * its magnitude)`."""
        if not self.comparable:
            return False
        return all(g.worst <= max(absolute_floor, relative_limit * g.magnitude) for g in self.gaps)


def difference(cached: Sequence[TensorLike], fresh: Sequence[TensorLike]) -> Difference:
    """Compare two results output by output (see `Difference`)."""
    mine = {t.name: t for t in cached}
    theirs = {t.name: t for t in fresh}
    if mine.keys() != theirs.keys():
        return Difference(comparable=False)
    gaps: list[OutputGap] = []
    epsilon = 0.0
    for name, tensor in mine.items():
        other = theirs[name]
        if tensor.datatype != other.datatype or tuple(tensor.shape) != tuple(other.shape):
            return Difference(comparable=False)
        if tensor.data == other.data:
            continue
        dtype = dtype_of(tensor.datatype)
        if dtype.kind != "f" or len(tensor.data) != len(other.data):
            return Difference(comparable=False)
        gap = _float_gap(np.frombuffer(tensor.data, dtype), np.frombuffer(other.data, dtype))
        if gap is None:
            return Difference(comparable=False)
        gaps.append(gap)
        epsilon = max(epsilon, float(np.finfo(dtype).eps))
    return Difference(comparable=True, gaps=tuple(gaps), epsilon=epsilon)


def _float_gap(cached: np.ndarray, fresh: np.ndarray) -> OutputGap | None:
    a, b = cached.astype(np.float64), fresh.astype(np.float64)
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    same_specials = np.array_equal(a[~finite_a], b[~finite_b], equal_nan=True)
    if not np.array_equal(finite_a, finite_b) or not same_specials:
        return None  # a NaN or an infinity that only one side has, or of another sign
    if not finite_b.any():
        return OutputGap(0.0, 0.0)
    worst = float(np.max(np.abs(a[finite_a] - b[finite_b])))
    magnitude = float(np.max(np.abs(b[finite_b])))
    return OutputGap(worst, magnitude)


class DeviationBook:
    """Per model version, the largest relative batch-vs-single deviation measured (rule 2)."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self._measured: OrderedDict[tuple[str, str], float] = OrderedDict()

    def measured(self, model: str, version: str) -> float | None:
        """The deviation learned for the version (None: never measured)."""
        return self._measured.get((model, version))

    def limit(self, model: str, version: str, epsilon: float) -> float:
        """The relative tolerance for the version's outputs of dtype epsilon `epsilon`."""
        return self.margin * max(epsilon, self._measured.get((model, version), 0.0))

    def learn(self, model: str, version: str, relative: float) -> float:
        """Record one measurement (capped at MAX_RELATIVE_DEVIATION); the version's deviation now."""
        key = (model, version)
        value = max(self._measured.pop(key, 0.0), min(relative, MAX_RELATIVE_DEVIATION))
        self._measured[key] = value
        while len(self._measured) > MAX_TRACKED:
            self._measured.popitem(last=False)
        return value


class AuditBudget:
    """Rule 1: which sampled hits may be audited now."""

    def __init__(self, *, fraction: float, rate: float, burst: int, max_inflight: int) -> None:
        self.fraction = fraction
        self.rate = rate
        self.burst = burst
        self.max_inflight = max_inflight
        self.in_flight = 0
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, tenant: str, now: float, draw: float) -> bool:
        """Whether to audit a hit of `tenant` (`draw`: uniform in [0, 1)); on True the caller must call
        `finished` once the audit ends."""
        if draw >= self.fraction or self.in_flight >= self.max_inflight:
            return False
        bucket = self._buckets.pop(tenant, None) or TokenBucket(self.rate, self.burst, updated=now)
        self._buckets[tenant] = bucket
        while len(self._buckets) > MAX_TRACKED:
            self._buckets.popitem(last=False)
        if bucket.try_take(now):
            return False
        self.in_flight += 1
        return True

    def finished(self) -> None:
        """An audit admitted by `admit` has ended."""
        self.in_flight = max(0, self.in_flight - 1)


@dataclass
class _Record:
    strikes: list[float]
    banned_until: float = -math.inf


class Strikes:
    """Rule 3: mismatches per (tenant, model), and the bypass they earn."""

    def __init__(self, *, limit: int, ban_s: float) -> None:
        self.limit = limit
        self.ban_s = ban_s
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()

    def strike(self, tenant: str, model: str, now: float) -> bool:
        """Count one mismatch; whether the pair now bypasses the cache (newly or still)."""
        record = self._records.pop((tenant, model), None) or _Record([])
        record.strikes = ([t for t in record.strikes if t > now - self.ban_s] + [now])[-self.limit :]
        if len(record.strikes) >= self.limit:
            record.banned_until = now + self.ban_s
        self._records[(tenant, model)] = record
        while len(self._records) > MAX_TRACKED:
            self._records.popitem(last=False)
        return record.banned_until > now

    def banned(self, tenant: str, model: str, now: float) -> bool:
        """Whether this tenant's requests to this model bypass the cache now."""
        record = self._records.get((tenant, model))
        return record is not None and record.banned_until > now

    def bans(self, now: float) -> list[tuple[str, str]]:
        """The (tenant, model) pairs bypassing the cache now."""
        return [pair for pair, record in self._records.items() if record.banned_until > now]
