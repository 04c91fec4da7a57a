"""The open-loop schedule: when each request is sent and what it is, fixed before the first one is sent.

Rule: the schedule depends only on the scenario and its seed, never on how the server answers, so a slow
server cannot slow the offered load down (no coordinated omission).

It holds exactly N = round(rate * duration_s) arrivals. Gaps are drawn from the process (unit mean) and the
N + 1 partial sums scaled so that they span the duration: arrival k is at T * S_k / S_{N+1}. For Poisson
this is the exact construction of a Poisson process conditioned on N arrivals in [0, T] (uniform order
statistics); for gamma gaps it keeps the gaps' CV and shape. Either way the offered rate is exact, and two
seeds differ only in where the bursts fall. Independent random streams (SeedSequence.spawn) draw the
times, the class of each arrival, and the payload variant, so changing one never shifts the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluice_inference.bench.loadgen_scenario import Arrivals, Scenario

STREAMS = 4
"""Random streams spawned from the seed: times, classes, variants, payload data (used by the runner)."""


@dataclass(frozen=True)
class Schedule:
    """Arrays indexed by request: offset from the start, class index, and a uniform draw picking a variant."""

    times_s: npt.NDArray[np.float64]
    classes: npt.NDArray[np.int64]
    variant_draws: npt.NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.times_s)


def unit_gaps(arrivals: Arrivals, count: int, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """`count` inter-arrival gaps with mean 1: exponential, or gamma with shape 1/cv² and scale cv²."""
    if arrivals.process == "poisson":
        return rng.exponential(1.0, count)
    assert arrivals.cv is not None  # enforced by Arrivals
    shape = 1.0 / arrivals.cv**2
    return rng.gamma(shape, 1.0 / shape, count)


def arrival_times(
    arrivals: Arrivals, count: int, duration_s: float, rng: np.random.Generator
) -> npt.NDArray[np.float64]:
    """`count` sorted arrival offsets in (0, duration_s), spaced by the process (see the module rule)."""
    if count == 0:
        return np.zeros(0)
    sums = np.cumsum(unit_gaps(arrivals, count + 1, rng))
    if sums[-1] <= 0:  # every gap underflowed to 0 (only with an absurd cv): spread evenly instead
        return np.linspace(0, duration_s, count + 2)[1:-1]
    times: npt.NDArray[np.float64] = sums[:-1] * (duration_s / sums[-1])
    return times


def class_picks(weights: list[float], count: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """The class index of each arrival, drawn independently with probability proportional to its weight."""
    p = np.asarray(weights, dtype=np.float64)
    picks: npt.NDArray[np.int64] = rng.choice(len(p), size=count, p=p / p.sum()).astype(np.int64)
    return picks


def random_streams(seed: int) -> list[np.random.Generator]:
    """The independent generators a scenario's seed gives (times, classes, variants, payload data)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(STREAMS)]


def build_schedule(scenario: Scenario) -> Schedule:
    """The whole run's schedule."""
    times_rng, classes_rng, variants_rng, _ = random_streams(scenario.seed)
    count = scenario.scheduled
    return Schedule(
        times_s=arrival_times(scenario.arrivals, count, scenario.duration_s, times_rng),
        classes=class_picks([c.weight for c in scenario.classes], count, classes_rng),
        variant_draws=variants_rng.random(count),
    )
