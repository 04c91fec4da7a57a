"""Online estimates of batch execution time, t(n) = a + b·n per model version.

The router core measures every batch as the router sees it — from when the worker could start it to its
answer, or the worker's reported forward time if longer (router/policy/core.py, `_learn`) — with its
size; each model version (and each lane shape, and each worker) keeps an exponentially weighted
least-squares fit so the estimate follows drift (a GPU warming up, a noisy neighbour) within a few dozen
batches. Until enough distinct batch sizes were seen, the fit is seeded from the worker's warm-up timings.
Estimates are conservative where it matters: `a` and `b` never go negative, and admission multiplies by a
margin (config `admission.estimate_margin`). A lane shape's fits last as long as the core keeps the shape
(router/policy/shapes.py: a bounded number per model), then `forget_shape` drops them.

Beside the fit, each model version keeps a best-case floor (`BestCase`): the fastest its batches have gone,
at warm-up or live, never inflated by load and never decayed. Admission answers INVALID_ARGUMENT only to a
deadline below it (docs/admission.md, "Refusals: terminal or retryable").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sluice_inference.router.policy.lanes import LaneKey

DECAY: Final = 0.97
"""Weight kept by the past at each observation (≈ the last 33 batches dominate)."""
DEFAULT_SECONDS: Final = 0.005
"""Prior for a model nobody has measured yet: 5 ms per batch, per-item cost unknown."""


@dataclass
class _Sums:
    w: float = 0.0
    sn: float = 0.0
    st: float = 0.0
    snn: float = 0.0
    snt: float = 0.0

    def add(self, rows: int, seconds: float, weight: float, decay: float = 1.0) -> None:
        self.w = self.w * decay + weight
        self.sn = self.sn * decay + weight * rows
        self.st = self.st * decay + weight * seconds
        self.snn = self.snn * decay + weight * rows * rows
        self.snt = self.snt * decay + weight * rows * seconds


PRIOR_WEIGHT: Final = 1.0
"""Weight of each warm-up point in every fit. It never decays: under steady load every batch has about
the same size, so the live data alone cannot tell the per-row cost from the fixed cost, and the slope
would drift; the warm-up points (batch 1 and the full batch) keep it anchored."""


@dataclass
class LatencyModel:
    """Exponentially weighted least squares of t against n, on top of a fixed warm-up prior."""

    live: _Sums = field(default_factory=_Sums)
    prior: _Sums = field(default_factory=_Sums)
    observations: int = 0
    _fitted: tuple[float, float] | None = None
    """(a, b) as of the last point added: the core asks many times per batch, points come once."""

    def observe(self, rows: int, seconds: float, weight: float = 1.0) -> None:
        """Add one (batch size, duration) point."""
        self.live.add(rows, seconds, weight, DECAY)
        self.observations += 1
        self._fitted = None

    def anchor(self, rows: int, seconds: float) -> None:
        """Add a warm-up point to the prior that never decays."""
        self.prior.add(rows, seconds, PRIOR_WEIGHT)
        self._fitted = None

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of t(n) = a + b·n; with one distinct size, all of t is charged to the fixed cost a."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float]:
        w = self.live.w + self.prior.w
        if w == 0:
            return DEFAULT_SECONDS, 0.0
        sn, st = self.live.sn + self.prior.sn, self.live.st + self.prior.st
        snn, snt = self.live.snn + self.prior.snn, self.live.snt + self.prior.snt
        mean_n, mean_t = sn / w, st / w
        var_n = snn / w - mean_n * mean_n
        if var_n <= 1e-9:
            return max(0.0, mean_t), 0.0
        b = max(0.0, (snt / w - mean_n * mean_t) / var_n)
        a = max(0.0, mean_t - b * mean_n)
        return a, b

    def predict(self, rows: int) -> float:
        """Expected seconds for a batch of `rows`."""
        a, b = self.coefficients()
        return a + b * rows


MAX_ANCHORS: Final = 64
"""Batch sizes a best-case floor keeps (warm-up sizes come from worker records in etcd: bound them)."""


@dataclass
class BestCase:
    """The fastest a model version has run a batch, as a floor no load can beat.

    It keeps, for a few anchor sizes m (size 1 and the warm-up sizes), the lowest time seen for a batch of
    at least m rows: a batch of n ≥ m rows that took s seconds shows t(m) ≤ s. A request of `rows` cannot
    run faster than the best of any anchor m ≤ rows, assuming more rows never run faster, so its floor is
    the largest of those. It errs low (a lucky batch, a small anchor under a large request), never high
    from load: slow batches never raise it, and nothing decays it.
    Invariant: `lowest[m]` ≤ every time seen for a batch of ≥ m rows since m became an anchor.
    """

    lowest: dict[int, float] = field(default_factory=lambda: {1: math.inf})
    _floors: dict[int, float] = field(default_factory=dict)
    """`seconds` by rows as of the last change (admission asks once per request; a floor moves rarely)."""

    def anchor(self, rows: int, seconds: float) -> None:
        """A warm-up timing: `rows` becomes an anchor (a bounded number of them) at most `seconds`."""
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        if rows not in self.lowest and len(self.lowest) >= MAX_ANCHORS:
            return
        self.lowest[rows] = min(self.lowest.get(rows, math.inf), seconds)
        self._floors.clear()

    def observe(self, rows: int, seconds: float) -> None:
        """A batch of `rows` took `seconds`: every anchor up to `rows` is at most that."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        for size, lowest in self.lowest.items():
            if size <= rows and seconds < lowest:
                self.lowest[size] = seconds
                self._floors.clear()

    def seconds(self, rows: int) -> float:
        """The best-case time of a batch of `rows`; 0.0 while nothing is known about so few rows."""
        floor = self._floors.get(rows)
        if floor is None:
            known = [s for size, s in self.lowest.items() if size <= rows and math.isfinite(s)]
            floor = self._floors[rows] = max(known, default=0.0)
        return floor


MAX_ANSWERS: Final = 4096
"""Most remembered `batch_seconds` answers between two changes of the fits (sizes x workers x shapes)."""
WORKER_FIT_AFTER: Final = 5
"""Reports a fit needs before it replaces a more general one (worker+shape → shape → model)."""
Shape = tuple[tuple[str, tuple[int, ...]], ...]
"""A lane's shape signature (LaneKey.shape)."""


class ServiceEstimates:
    """A LatencyModel per (model, version), and per (model, version, worker), seeded from warm-up."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], LatencyModel] = {}
        self._shapes: dict[tuple[str, str, Shape], LatencyModel] = {}
        self._workers: dict[tuple[str, str, Shape], dict[str, LatencyModel]] = {}
        """Per lane shape (() for none), each worker's fit: a shape's fits are forgotten together."""
        self._priors: dict[tuple[str, str], dict[int, float]] = {}
        self._best: dict[tuple[str, str], BestCase] = {}
        self._answers: dict[tuple[str, str, int, str, Shape], float] = {}
        """`batch_seconds` as of the last change to any fit: the core asks the same few questions (one row,
        the full batch) for every request, and fits change once per answered batch."""
        self._admission: dict[tuple[LaneKey, int, int], tuple[float, float, float]] = {}
        """`admission_seconds` as of the last change to any fit or floor (cleared with `_answers`, and
        bounded like it)."""

    def seed(self, model: str, version: str, warmup: Mapping[int, float]) -> None:
        """Seed a version that has no observations yet from its warm-up timings (batch size → seconds);
        every worker's warm-up lowers the version's best-case floor, measured or not."""
        self._changed()
        key = (model, version)
        best = self._best.setdefault(key, BestCase())
        for rows, seconds in warmup.items():
            best.anchor(rows, seconds)
        if key in self._models and self._models[key].observations:
            return
        fit = LatencyModel()
        for rows, seconds in sorted(warmup.items()):
            fit.anchor(rows, seconds)
        self._models[key] = fit
        self._priors[key] = dict(warmup)

    def observe(
        self, model: str, version: str, rows: int, seconds: float, worker: str = "", *, shape: Shape = ()
    ) -> None:
        """A worker reported a batch (of the lane with this shape signature)."""
        self._changed()
        key = (model, version)
        best = self._best.get(key)
        if best is None:  # not `setdefault`, which would build a floor on every batch
            best = self._best[key] = BestCase()
        best.observe(rows, seconds)
        self._fit(self._models, key, model, version).observe(rows, seconds)
        if shape:
            self._fit(self._shapes, (model, version, shape), model, version).observe(rows, seconds)
        if worker:
            per_worker = self._workers.setdefault((model, version, shape), {})
            self._fit(per_worker, worker, model, version).observe(rows, seconds)

    def _changed(self) -> None:
        """A fit or a floor changed: every remembered answer may be stale."""
        self._answers.clear()
        self._admission.clear()

    def _fit(self, fits: dict[Any, LatencyModel], key: Any, model: str, version: str) -> LatencyModel:
        """The fit under `key`, created with the model's warm-up prior."""
        fit = fits.get(key)
        if fit is None:
            fit = fits[key] = LatencyModel()
            for rows, seconds in sorted(self._priors.get((model, version), {}).items()):
                fit.anchor(rows, seconds)
        return fit

    def batch_seconds(
        self, model: str, version: str, rows: int, worker: str = "", shape: Shape = ()
    ) -> float:
        """Expected execution time of a batch of `rows`: the worker's own fit for this lane shape once it
        has reported enough, else the lane shape's fit across workers, else the model's across shapes (a
        bucket of long inputs and one of short inputs cost very differently per row)."""
        question = (model, version, rows, worker, shape)
        answer = self._answers.get(question)
        if answer is None:
            if len(self._answers) >= MAX_ANSWERS:
                self._answers.clear()
            answer = self._answers[question] = self._batch_seconds(model, version, rows, worker, shape)
        return answer

    def admission_seconds(self, key: LaneKey, rows: int, full_rows: int) -> tuple[float, float, float]:
        """What admission reads for a request of `rows` in lane `key`, asked at once (per arrival):
        `batch_seconds` of its rows and of the lane's full batch (`full_rows`), and `best_case_seconds`
        of its rows."""
        question = (key, rows, full_rows)
        answer = self._admission.get(question)
        if answer is None:
            if len(self._admission) >= MAX_ANSWERS:
                self._admission.clear()
            model, version, shape = key
            answer = self._admission[question] = (
                self.batch_seconds(model, version, rows, shape=shape),
                self.batch_seconds(model, version, full_rows, shape=shape),
                self.best_case_seconds(model, version, rows),
            )
        return answer

    def _batch_seconds(self, model: str, version: str, rows: int, worker: str, shape: Shape) -> float:
        # Asked again after every answered batch (each clears the answers): plain lookups, no tuple to
        # loop over.
        fit: LatencyModel | None
        if worker and (per_worker := self._workers.get((model, version, shape))) is not None:
            fit = per_worker.get(worker)
            if fit is not None and fit.observations >= WORKER_FIT_AFTER:
                return fit.predict(rows)
        if shape:
            fit = self._shapes.get((model, version, shape))
            if fit is not None and fit.observations >= WORKER_FIT_AFTER:
                return fit.predict(rows)
        fit = self._models.get((model, version))
        return DEFAULT_SECONDS if fit is None else fit.predict(rows)

    def best_case_seconds(self, model: str, version: str, rows: int) -> float:
        """What no load can beat for a batch of `rows` (`BestCase`), across workers and lane shapes (a
        short-input bucket's time is a floor for a long one); 0.0 for a version never timed."""
        best = self._best.get((model, version))
        return 0.0 if best is None else best.seconds(rows)

    def forget_worker(self, worker: str) -> None:
        """Drop a departed worker's fits (a replacement with the same name may be a different machine)."""
        self._changed()
        for key, per_worker in list(self._workers.items()):
            per_worker.pop(worker, None)
            if not per_worker:
                del self._workers[key]

    def forget_shape(self, model: str, version: str, shape: Shape) -> None:
        """Drop a lane shape's fits, across workers and per worker (the shape went idle and its model
        needs the room: router/policy/shapes.py); the version's own fit and floor stay."""
        self._changed()
        self._shapes.pop((model, version, shape), None)
        self._workers.pop((model, version, shape), None)

    def fits(self) -> int:
        """Fits held: per version, per lane shape, per lane shape and worker."""
        return len(self._models) + len(self._shapes) + sum(len(w) for w in self._workers.values())
