"""The plan of one run: a scenario plus a variant, turned into arrivals, lanes and limits (pure).

Rules:
- arrivals come from the load generator's schedule code (`sluice_inference.bench.loadgen_schedule`) with the
  same random streams, so a simulator scenario and a `sluice bench` scenario with the same seed, rate,
  duration and class weights offer exactly the same arrival times and class picks;
- a variant that drops classes removes their arrivals from the *same* schedule: the remaining classes
  see identical arrival times in both runs, so a comparison isolates the dropped traffic's effect;
- each class's lane is its shape bucket (model, version, input length), as the router keys lanes; the
  limits are the model's, as `router/driver.py` builds them from the record for every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice_inference.bench.loadgen_schedule import arrival_times, class_picks, random_streams
from sluice_inference.bench.sim.scenario import ModelSpec, Policy, SimScenario, Variant
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits

DEFAULT_VARIANTS = [
    Variant(name="adaptive + expected_completion", policy={"batcher": "adaptive"}),
    Variant(name="timer + expected_completion", policy={"batcher": "timer"}),
    Variant(name="adaptive + least_loaded", policy={"scheduler": "least_loaded"}),
    Variant(name="adaptive + round_robin", policy={"scheduler": "round_robin"}),
    Variant(name="timer + round_robin", policy={"batcher": "timer", "scheduler": "round_robin"}),
]
"""The batcher x scheduler matrix compared when a scenario lists no variants."""


def variants_of(scenario: SimScenario) -> list[Variant]:
    """The scenario's variants, or the default policy matrix."""
    return list(scenario.variants) or DEFAULT_VARIANTS


@dataclass(frozen=True)
class RunPlan:
    """Everything one run needs, fixed before it starts."""

    scenario: SimScenario
    """The scenario with the variant's model changes applied."""
    policy: Policy
    variant: str
    rate: float
    capacity_rps: float
    """The base scenario's capacity (what load multiples refer to)."""
    times_s: list[float]
    classes: list[int]
    lanes: list[LaneKey]
    """Lane of each class (one shared lane when the policy pads)."""
    limits: list[LaneLimits]
    """Batching limits of each class's lane."""

    @property
    def arrivals(self) -> int:
        """How many requests arrive."""
        return len(self.times_s)


def lane_keys(scenario: SimScenario, policy: Policy) -> list[LaneKey]:
    """Each class's lane: its own shape bucket, or one lane at the longest length when padded."""
    model = scenario.model
    longest = max(c.length for c in scenario.classes)
    keys = []
    for c in scenario.classes:
        length = longest if policy.padded else c.length
        keys.append(LaneKey(model.name, model.version, (("x", (length,)),)))
    return keys


def lane_limits(model: ModelSpec) -> LaneLimits:
    """What the shell passes to admission for every lane of the model (as `router/driver.py` does)."""
    return LaneLimits(model.max_batch_size, model.max_wait_ms / 1000.0, model.max_batch_cost)


def plan_run(scenario: SimScenario, variant: Variant | None = None, rate: float | None = None) -> RunPlan:
    """The arrivals and policy of one run (`rate` overrides the scenario's)."""
    offered = rate if rate is not None else scenario.offered_rate
    count = round(offered * scenario.duration_s)
    times_rng, classes_rng, _, _ = random_streams(scenario.seed)
    times = arrival_times(scenario.arrivals, count, scenario.duration_s, times_rng)
    picks = class_picks([c.weight for c in scenario.classes], count, classes_rng)
    policy = scenario.policy
    base_capacity = scenario.capacity_rps
    if variant is not None:
        policy = Policy.model_validate({**policy.model_dump(), **variant.policy})
        if variant.model:
            model = ModelSpec.model_validate({**scenario.model.model_dump(), **variant.model})
            scenario = scenario.model_copy(update={"model": model})
        dropped = [i for i, c in enumerate(scenario.classes) if c.name in variant.drop_classes]
        if dropped:
            keep = ~np.isin(picks, dropped)
            times, picks = times[keep], picks[keep]
    lanes = lane_keys(scenario, policy)
    return RunPlan(
        scenario=scenario, policy=policy, variant=variant.name if variant else "plain",
        rate=offered, capacity_rps=base_capacity, times_s=times.tolist(), classes=picks.tolist(),
        lanes=lanes, limits=[lane_limits(scenario.model) for _ in lanes],
    )  # fmt: skip
