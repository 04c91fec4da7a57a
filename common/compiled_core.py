"""Load the policy core compiled by mypyc when a build of exactly these sources exists; else pure Python.

Why: the core and the simulator are the same typed Python, and mypyc (it comes with mypy) compiles them to C
extensions that run the simulator about two and a half times as fast with every decision unchanged
(docs/performance.md, "The late night of 2026-12-04"). `make compile` builds them (common/core_build.py) into
`.build/compiled/`, never beside the sources: a compiled module beside its source would shadow it, and an
edited source would silently run the old code.

Rules:
- A build is used only while every source it was compiled from (the compiled modules and everything of
  Sluice's they import, listed in its manifest) hashes to the build's key; one edit anywhere in that set
  and the whole core runs as Python until the next `make compile`. The check is lazy: it runs when the
  first compiled module is imported, so a process that never imports the core pays nothing.
- All or nothing: a build serves every module it holds or none, so compiled and interpreted copies of one
  class never meet.
- `SLUICE_PURE_PYTHON=1` in the environment turns the build off for a process. It chooses how code is
  loaded, never what it decides, and is read once, when `sluice_inference` is first imported (the
  differential test runs four scenarios both ways in child processes).
- `status()` says which one runs and why, for logs and `sluice sim`.

What compiling asks of the compiled modules' code: their classes take no interpreted subclasses (tests wrap
them instead); a class built per request writes its `__init__` out, because mypyc leaves the one a dataclass
generates interpreted; and the sources must say what they mean in types, since mypyc checks them at run time.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "sluice_inference"
# Not resolved: in a checkout `sluice_inference/common` is a link to `common/`, and the package folder is the
# link's parent.
PACKAGE_DIR = Path(__file__).absolute().parent.parent
ROOT = PACKAGE_DIR.parent
BUILD_DIR = ROOT / ".build" / "compiled"
MANIFEST = BUILD_DIR / "manifest.json"
PURE_PYTHON_ENV = "SLUICE_PURE_PYTHON"
# The one shared library every compiled module's shim imports (mypyc's "group"), inside our package so that
# it takes no top-level name.
GROUP = f"{PACKAGE}.policy_core"
# Compiled: the policy core (every module of router/policy but its package file), the batching rule it
# shares with the worker, and the simulator's engine that drives it.
POLICY_PACKAGE = "router/policy"
EXTRA_MODULES = (
    "common/batching.py",
    "bench/sim/engine.py",
    "bench/sim/workers.py",
    "bench/sim/results.py",
    "bench/loadgen_stats.py",
)


def compiled_sources() -> list[Path]:
    """The source files mypyc compiles, as paths under `sluice_inference/` (what mypyc names them by)."""
    policy = sorted((PACKAGE_DIR / POLICY_PACKAGE).glob("*.py"))
    return [path for path in policy if path.name != "__init__.py"] + [PACKAGE_DIR / m for m in EXTRA_MODULES]


def module_name(path: Path) -> str:
    """`sluice_inference/router/policy/core.py` → `sluice_inference.router.policy.core`."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _module_file(name: str) -> Path | None:
    """The source of one of Sluice's modules (a package's `__init__.py`), None for any other name."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path) -> set[str]:
    """Every module name `path` imports, at any depth of the file (TYPE_CHECKING blocks included: mypyc
    compiles against what the type checker saw), each with its parent packages."""
    names: set[str] = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    with_parents = set(names)
    for name in names:
        parts = name.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return with_parents


def source_closure(sources: Iterable[Path]) -> list[Path]:
    """The compiled sources and every source of Sluice's they import, transitively: what a build's
    correctness depends on (mypyc compiles against the types and constants of the modules it imports)."""
    seen: set[Path] = set()
    pending = list(sources)
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported(path):
            found = _module_file(name)
            if found is not None and found not in seen:
                pending.append(found)
    return sorted(seen)


def source_key(files: Sequence[Path], root: Path = ROOT) -> str:
    """One digest of the files' names (from `root`) and contents, and of the interpreter the build is for."""
    digest = hashlib.sha256(sys.implementation.cache_tag.encode())
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class CompiledCoreFinder(importlib.abc.MetaPathFinder):
    """Serves the build's modules from `.build/compiled/` once its key matches the sources (checked at the
    first request for one of them); declines every other name, and every name when the key does not
    match, so the normal path finder loads the Python source."""

    def __init__(self, manifest: dict[str, object]) -> None:
        modules = manifest.get("modules")
        sources = manifest.get("sources")
        self._modules = {str(k): str(v) for k, v in modules.items()} if isinstance(modules, dict) else {}
        self._sources = [str(s) for s in sources] if isinstance(sources, list) else []
        self._key = str(manifest.get("key", ""))
        self._verdict: str | None = None  # None: not checked yet; "": in use; else why not

    @property
    def key(self) -> str:
        """The build's key: the digest of the sources it was compiled from."""
        return self._key

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        relative = self._modules.get(fullname)
        if relative is None or self.verdict():
            return None
        location = str(BUILD_DIR / relative)
        return importlib.machinery.ModuleSpec(
            fullname, importlib.machinery.ExtensionFileLoader(fullname, location), origin=location
        )

    def verdict(self) -> str:
        """'' while the build is in use, else why the core runs as Python (checked once)."""
        if self._verdict is None:
            self._verdict = self._check()
        return self._verdict

    def _check(self) -> str:
        missing = [rel for rel in self._modules.values() if not (BUILD_DIR / rel).is_file()]
        if missing or not self._modules:
            return f"the build in {BUILD_DIR} is incomplete; run make compile"
        try:
            key = source_key([ROOT / rel for rel in self._sources])
        except OSError as gone:
            return f"a source the build was compiled from is gone ({gone.filename}); run make compile"
        if key != self._key:
            return "the sources changed since the last make compile"
        return ""


class _Loading:
    """This process's choice, made once by `install`: the finder in use, or why there is none."""

    finder: CompiledCoreFinder | None = None
    declined = f"no compiled build in {BUILD_DIR} (make compile builds one)"


def install() -> None:
    """Put the finder first on `sys.meta_path` when a build exists and the environment does not turn it
    off (once per process; `sluice_inference/__init__.py` calls it)."""
    if _Loading.finder is not None or any(isinstance(f, CompiledCoreFinder) for f in sys.meta_path):
        return
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        _Loading.declined = f"{PURE_PYTHON_ENV} is set"
        return
    try:
        manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except (OSError, ValueError) as unreadable:
        _Loading.declined = f"the build's manifest {MANIFEST} is unreadable ({unreadable}); run make compile"
        return
    if not isinstance(manifest, dict):
        _Loading.declined = f"the build's manifest {MANIFEST} is not an object; run make compile"
        return
    _Loading.finder = CompiledCoreFinder(manifest)
    sys.meta_path.insert(0, _Loading.finder)


def status() -> str:
    """Which policy core this process runs: 'compiled (mypyc, build <key>)' or 'pure Python (<why>)'."""
    finder = _Loading.finder
    if finder is None:
        return f"pure Python ({_Loading.declined})"
    verdict = finder.verdict()
    return f"pure Python ({verdict})" if verdict else f"compiled (mypyc, build {finder.key[:12]})"


def is_compiled(module: ModuleType) -> bool:
    """Whether `module` was loaded from a compiled build (for tests and reports)."""
    return isinstance(module.__spec__ and module.__spec__.loader, importlib.machinery.ExtensionFileLoader)
