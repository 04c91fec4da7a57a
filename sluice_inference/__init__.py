"""Sluice's one top-level import package: `sluice_inference.common`, `.router`, `.worker`, `.cli`, `.bench`.

Why it exists: installed, the packages must not take names other projects use (a service with its own
`common` package could not install the client library beside it). The repository keeps `common/`,
`router/`, `worker/`, `cli/` and `bench/` at its top level, as the design card fixes; the entries here are
relative symbolic links to those folders, so the source exists once. The wheel holds real files (setuptools
follows the links) and the Docker build copies this folder and the linked ones.

Every import names the package here (`from sluice_inference.common.client import SluiceClient`); loading a
file under its old top-level name too would give two copies of one module, so
tests/unit/test_package_names.py fails on any such import. Type-check `sluice_inference tests`, not the
folders themselves, for the same reason.
"""

from sluice_inference.common import compiled_core

# Before any module of the policy core is imported: a build of exactly these sources, if one exists, serves
# them compiled (common/compiled_core.py says when, and why it is safe).
compiled_core.install()
