"""Load-generator scenarios: the YAML schema (pydantic), loading and validation with the offending key named.

A scenario says where to send (`target`), for how long (`duration_s`), how much (`rate`, total arrivals per
second), with which arrival process, and the traffic mix (`classes`, each picked per arrival by weight).
docs/loadgen.md shows the format; every field below carries its meaning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_SCHEDULED = 5_000_000
"""Arrival times are precomputed; more than this many would take a lot of memory for no better figure."""


class ScenarioError(Exception):
    """A scenario that cannot be run; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Arrivals(_Strict):
    """How arrival times are spaced (their mean rate is the scenario's `rate`)."""

    process: Literal["poisson", "gamma"] = "poisson"
    """`poisson`: exponential gaps (independent arrivals). `gamma`: gamma gaps, burstier when cv > 1."""
    cv: float | None = Field(default=None, gt=0, le=100)
    """Coefficient of variation of the gaps (std / mean); gamma only, where it is required. 1 = Poisson."""

    @model_validator(mode="after")
    def _cv_goes_with_gamma(self) -> Arrivals:
        if self.process == "gamma" and self.cv is None:
            raise ValueError("cv is required when process is gamma")
        if self.process == "poisson" and self.cv is not None:
            raise ValueError("cv applies to process: gamma only")
        return self


class TrafficClass(_Strict):
    """One kind of request in the mix: who sends it, to which model, how urgent, how big."""

    name: str = Field(min_length=1)
    """Label in the report (unique within the scenario)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of arrivals, relative to the other classes' weights."""
    tenant_key: str | None = None
    """API key sent as `authorization: Bearer <key>`; none: no key (the anonymous tenant, if configured)."""
    tenant: str | None = None
    """Tenant label for the report; default: `anonymous` without a key, else the class name."""
    priority: int = Field(default=0, ge=0)
    """`parameters["priority"]`: 1 is the highest, 0 = the tenant's default (then not sent)."""
    model: str = Field(min_length=1)
    """Model name."""
    version: str = ""
    """Model version; empty: the latest ready."""
    deadline_ms: float = Field(gt=0)
    """Sent as the gRPC deadline and as `parameters["timeout"]` (µs); OK later than this is counted late."""
    rows: int = Field(default=1, ge=1)
    """Rows (the batch dimension) per request."""
    length: int | list[int] = 8
    """Size given to every variable (-1) dimension other than the batch; a list is drawn from uniformly."""
    cache: bool | None = None
    """`parameters["cache"]` when set (false bypasses the result cache); unset: not sent."""
    payloads: int = Field(default=8, ge=1, le=100_000)
    """Distinct random payloads per length, generated once at start and drawn from per request."""
    zipf: float | None = Field(default=None, gt=0, le=10)
    """Draw payloads Zipf-distributed with this exponent (payload k has weight 1/k^s), as real request
    mixes repeat popular inputs; unset: uniformly."""

    @field_validator("length")
    @classmethod
    def _lengths_positive(cls, value: int | list[int]) -> int | list[int]:
        values = value if isinstance(value, list) else [value]
        if not values or any(v < 1 for v in values):
            raise ValueError("must be a positive integer or a non-empty list of them")
        return value

    @property
    def lengths(self) -> list[int]:
        """The lengths to draw from."""
        return self.length if isinstance(self.length, list) else [self.length]

    @property
    def tenant_label(self) -> str:
        """How the report names this class's tenant."""
        if self.tenant:
            return self.tenant
        return "anonymous" if self.tenant_key is None else self.name


class Scenario(_Strict):
    """An open-loop load scenario."""

    target: str = "localhost:8001"
    """Router address, `host:port` (or a gRPC URI); `--target` overrides it."""
    duration_s: float = Field(gt=0, le=86_400)
    """Seconds over which arrivals are scheduled."""
    rate: float = Field(gt=0)
    """Mean arrivals per second, all classes together; the schedule holds round(rate * duration_s) of them."""
    arrivals: Arrivals = Arrivals()
    """The arrival process."""
    seed: int = 0
    """Seeds arrival times, class picks and payloads: the same seed gives the same schedule."""
    channels: int = Field(default=4, ge=1, le=256)
    """gRPC channels (each its own TCP connection) that requests are spread over, round robin."""
    classes: list[TrafficClass] = Field(min_length=1)
    """The traffic mix."""
    cluster_config: str | None = None
    """The sluice.yaml whose tenants own the classes' `tenant_key`s (a path relative to the scenario file;
    absolute once loaded): `sluice bench` names it when the target does not know one of the keys."""

    @model_validator(mode="after")
    def _sane(self) -> Scenario:
        names = [c.name for c in self.classes]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"classes: duplicate name(s) {', '.join(duplicated)}")
        if self.rate * self.duration_s > MAX_SCHEDULED:
            raise ValueError(f"rate * duration_s must be at most {MAX_SCHEDULED} requests")
        return self

    @property
    def scheduled(self) -> int:
        """How many requests the schedule holds."""
        return round(self.rate * self.duration_s)


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "scenario"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


def parse_scenario(data: Any, overrides: dict[str, Any] | None = None) -> Scenario:
    """A Scenario from parsed YAML plus top-level overrides (flags win); ScenarioError names the key."""
    if not isinstance(data, dict):
        raise ScenarioError("a scenario must be a mapping of keys (target, duration_s, rate, classes, ...)")
    merged = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return Scenario.model_validate(merged)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc)) from None


def load_scenario(path: Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    scenario = parse_scenario(data, overrides)
    if scenario.cluster_config is not None:
        resolved = (path.parent / scenario.cluster_config).resolve()
        scenario = scenario.model_copy(update={"cluster_config": str(resolved)})
    return scenario
