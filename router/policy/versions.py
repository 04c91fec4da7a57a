"""Version choice: which registered version of a model a request is served by.

Rule: the version asked for; with none asked, the highest one some worker accepts batches for right now (a
version registered but not yet connected would only answer UNAVAILABLE), else the highest registered.
"""

from __future__ import annotations

from collections.abc import Callable

from sluice_inference.common.records import ModelRecord
from sluice_inference.router.policy.catalog import ModelCatalog

Serves = Callable[[str, str], bool]
"""Whether an accepting worker serves (model, version) now."""


def version_to_serve(catalog: ModelCatalog, name: str, version: str, serves: Serves) -> ModelRecord:
    """The version to serve (see the module's rule); raises the catalog's typed error for an unknown one."""
    if not version:
        serving = [v for v in catalog.versions(name) if serves(name, v)]
        if serving:
            return catalog.resolve(name, serving[-1])
    return catalog.resolve(name, version)
