"""Compile the policy core with mypyc into `.build/compiled/` (`make compile`), for compiled_core.py to load.

Why a build of its own: mypyc's usual `setup.py` route writes each extension beside its source, where it
shadows the source for every later import, edited or not. Here a build goes into a folder of its own, with
a manifest naming the modules it serves and the digest of every source it was compiled from, and the loader
uses it only while that digest still matches. Idempotent: a build of the current sources is kept as it is.

Without a C compiler or mypyc (an install without the dev extra) there is nothing to build and the core runs
as Python, which decides exactly alike; that is said, not failed. A type error or a compiler error in a
machine that has both is a failure: a build that silently fell back would hide it.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from sluice_inference.common.compiled_core import (
    BUILD_DIR,
    GROUP,
    MANIFEST,
    ROOT,
    CompiledCoreFinder,
    compiled_sources,
    module_name,
    source_closure,
    source_key,
)

KEY_CHARS = 16  # of the digest, naming a build's folder


def _compiler() -> str | None:
    """The C compiler setuptools would use, if this machine has one."""
    configured = str(sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(configured[0]) if configured else None


def current_key() -> tuple[str, list[Path]]:
    """The key a build of the sources as they are now would carry, and the sources it covers."""
    closure = source_closure(compiled_sources())
    return source_key(closure), closure


def up_to_date(key: str) -> bool:
    """Whether the build in place is of exactly the current sources (`key`: a new import can add one) and
    the loader would serve it."""
    try:
        manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("key") == key
        and not CompiledCoreFinder(manifest).verdict()
    )


def _served_modules(build: Path) -> dict[str, str]:
    """Every extension module in `build`, by dotted name → its path relative to BUILD_DIR."""
    modules: dict[str, str] = {}
    # Longest first: every name ending in ".cpython-311-x86_64-linux-gnu.so" also ends in ".so".
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)
    for path in build.rglob("*"):
        relative = path.relative_to(build).as_posix()
        suffix = next((s for s in suffixes if relative.endswith(s)), None)
        if suffix is not None and path.is_file():
            modules[relative[: -len(suffix)].replace("/", ".")] = path.relative_to(BUILD_DIR).as_posix()
    return modules


def build(key: str, closure: list[Path], *, jobs: int) -> Path:
    """Compile into BUILD_DIR/<key>/, then point the manifest at it and remove older builds."""
    from mypyc.build import mypycify  # a dev dependency: only the build needs it
    from setuptools import setup

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    target = BUILD_DIR / key[:KEY_CHARS]
    shutil.rmtree(target, ignore_errors=True)
    paths = [str(path.relative_to(ROOT)) for path in compiled_sources()]
    with tempfile.TemporaryDirectory(dir=BUILD_DIR, prefix="work-") as work:
        # mypyc names each module by its path from the working directory, and reads pyproject's mypy config
        # from it.
        here = Path.cwd()
        os.chdir(ROOT)
        try:
            extensions = mypycify(paths, target_dir=str(Path(work) / "c"), group_name=GROUP)
            setup(
                name="sluice-policy-core",
                ext_modules=extensions,
                script_args=[
                    "--quiet", "build_ext", "--build-lib", str(target),
                    "--build-temp", str(Path(work) / "obj"), "--parallel", str(jobs),
                ],
            )  # fmt: skip
        finally:
            os.chdir(here)
    modules = _served_modules(target)
    expected = {module_name(path) for path in compiled_sources()} | {f"{GROUP}__mypyc"}
    if set(modules) != expected:
        raise SystemExit(f"the build in {target} serves {sorted(modules)}, expected {sorted(expected)}")
    manifest = {
        "key": key,
        "modules": modules,
        "sources": [str(path.relative_to(ROOT)) for path in closure],
    }
    staged = MANIFEST.with_suffix(".tmp")
    staged.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    staged.replace(MANIFEST)
    for old in BUILD_DIR.iterdir():
        if old.is_dir() and old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="C compilers run at once")
    args = parser.parse_args(argv)
    key, closure = current_key()
    if up_to_date(key):
        print(f"    the compiled policy core is up to date (build {key[:12]})")
        return 0
    compiler = _compiler()
    try:
        import mypyc  # noqa: F401  (only asking whether it is installed)
    except ImportError:
        compiler = None
    if compiler is None:
        print("    no C compiler or no mypyc here: the policy core runs as pure Python (it decides alike)")
        return 0
    target = build(key, closure, jobs=max(1, args.jobs))
    print(f"    compiled {len(compiled_sources())} modules into {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
