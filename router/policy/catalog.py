"""The model catalog: which model versions exist, built only from what workers registered in etcd.

The router never reads model files; a model exists while some registered worker has it loaded. Version
resolution: a request without a version goes to the highest version some *ready* worker serves, falling
back to the highest registered version (whose requests will then wait for or be refused a worker).
If workers disagree on a version's digest or tensor specs, the record of the oldest worker wins and the
disagreement is reported by `conflicts()` (a half-finished redeploy), rather than silently mixing them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sluice_inference.common.errors import NotFound
from sluice_inference.common.records import ModelRecord, WorkerRecord

SHOWN_NAME_CHARS: Final = 128
"""How much of a name the caller sent a refusal repeats (a name that matched nothing may be any length)."""


def _identity(record: ModelRecord) -> dict[str, object]:
    """What must agree across workers serving one version (warm-up timings are per machine)."""
    return record.model_dump(exclude={"warmup_s"})


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (-1, version)


class ModelCatalog:
    """Model name → version → record, from the current set of worker records."""

    def __init__(self) -> None:
        self._models: dict[str, dict[str, ModelRecord]] = {}
        self._sorted: dict[str, list[str]] = {}
        """Each model's versions, oldest first: sorted once per update, not per request."""
        self._ready: set[tuple[str, str]] = set()
        self._conflicts: list[str] = []

    def update(self, workers: Mapping[str, WorkerRecord]) -> None:
        """Rebuild from the full set of live worker records."""
        models: dict[str, dict[str, ModelRecord]] = {}
        ready: set[tuple[str, str]] = set()
        conflicts: list[str] = []
        for worker in sorted(workers.values(), key=lambda w: (w.started_at, w.worker_id)):
            for record in worker.models:
                versions = models.setdefault(record.name, {})
                known = versions.setdefault(record.version, record)
                if _identity(known) != _identity(record):
                    conflicts.append(f"{record.name}:{record.version} differs on worker {worker.worker_id}")
                if worker.state == "ready":
                    ready.add((record.name, record.version))
        self._models, self._ready, self._conflicts = models, ready, conflicts
        self._sorted = {name: sorted(versions, key=_version_order) for name, versions in models.items()}

    def names(self) -> list[str]:
        """Every model some worker registered."""
        return sorted(self._models)

    def versions(self, name: str) -> list[str]:
        """Registered versions of a model, oldest first."""
        return list(self._sorted.get(name, ()))

    def resolve(self, name: str, version: str = "") -> ModelRecord:
        """The record serving `name` at `version` ("" → latest ready); NotFound otherwise."""
        versions = self._models.get(name)
        if not versions:
            raise NotFound(f"unknown model {name[:SHOWN_NAME_CHARS]!r}", reason="unknown_model")
        if version:
            try:
                return versions[version]
            except KeyError:
                known = ", ".join(self.versions(name))
                raise NotFound(
                    f"model {name!r} has no version {version[:SHOWN_NAME_CHARS]!r} (registered: {known})",
                    reason="unknown_version",
                ) from None
        ready = [v for v in versions if (name, v) in self._ready]
        return versions[max(ready or list(versions), key=_version_order)]

    def conflicts(self) -> list[str]:
        """Versions whose registrations disagree across workers."""
        return list(self._conflicts)
