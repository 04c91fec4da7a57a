"""A fingerprint of what the simulator decided, to show that a speed-up changed no decision.

The simulator is seeded, so a change that only makes the policy core or the event loop cheaper must leave
every run's per-request outcomes exactly as they were. `fingerprint` hashes one run's outcome of every
request (class, arrival, latency, status, reason, hint), the rows of every batch and forward, the cut
reasons, each worker's counters and the summary (all but its wall and CPU times); the command prints one
fingerprint per run of each scenario given — the scenario as written, and each of its variants (or the
default policy matrix) over a short stretch — and, with `--against`, compares them with a saved set.

Run: python -m sluice_inference.bench.sim.fingerprint bench/scenarios/sim_*.yaml --out before.json
     ... change the code ...
     python -m sluice_inference.bench.sim.fingerprint bench/scenarios/sim_*.yaml --against before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import RunPlan, plan_run, variants_of
from sluice_inference.bench.sim.results import SimResult
from sluice_inference.bench.sim.scenario import load_sim_scenario
from sluice_inference.common import compiled_core

VARIANT_SECONDS = 0.05
"""Virtual seconds of arrivals each variant runs (the scenario as written runs its full duration)."""


def fingerprint(result: SimResult) -> str:
    """A short hash of everything the run decided (nothing that depends on how fast it ran)."""
    digest = hashlib.sha256()
    for r in result.records:
        digest.update(repr((r.cls, r.scheduled_s, r.latency_s, r.code, r.reason, r.hint)).encode())
    workers = [(w.worker_id, w.batches, w.rows, w.busy_s, w.max_held) for w in result.workers]
    counters = (result.batch_rows, result.forward_rows, sorted(result.cut_reasons.items()), result.late_rows,
                result.redispatched, result.end_s, result.events, workers)  # fmt: skip
    digest.update(repr(counters).encode())
    summary = result.summary()
    summary.pop("sim")  # wall and CPU seconds
    digest.update(json.dumps(summary, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def runs(paths: Sequence[Path], variant_seconds: float = VARIANT_SECONDS) -> Iterator[tuple[str, RunPlan]]:
    """Each scenario as written, then each of its variants over `variant_seconds`, named."""
    for path in paths:
        yield path.name, plan_run(load_sim_scenario(path))
        short = load_sim_scenario(path, {"duration_s": variant_seconds})
        for variant in variants_of(short):
            yield f"{path.name}: {variant.name}", plan_run(short, variant)


def main(argv: list[str] | None = None) -> int:
    """Print each run's fingerprint; exit 1 when `--against` finds one that differs or is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="+", type=Path, help="simulator scenario YAML files")
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--against", type=Path, help="compare with fingerprints written by --out")
    args = parser.parse_args(argv)
    expected = json.loads(args.against.read_text()) if args.against else None
    found: dict[str, str] = {}
    differ = []
    for name, plan in runs(args.scenarios):
        found[name] = fingerprint(simulate(plan))
        same = "" if expected is None else ("  same" if expected.get(name) == found[name] else "  DIFFERS")
        print(f"{found[name]}  {plan.arrivals:>7,}  {name}{same}", flush=True)
        if same == "  DIFFERS":
            differ.append(name)
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    missing = [] if expected is None else sorted(set(expected) - set(found))
    if expected is not None:
        print(f"{len(found) - len(differ)} of {len(found)} runs identical; differ: {differ or 'none'}; "
              f"not run: {missing or 'none'}")  # fmt: skip
    print(f"policy core: {compiled_core.status()}")  # which one decided: compiled or pure Python
    return 1 if differ or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
