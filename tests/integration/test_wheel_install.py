"""A wheel built from this tree installs beside a user's own `common` package: both import, and the
installed `sluice` runs.

Why: the wheel used to take the top-level names `common`, `router`, `worker`, `cli` and `bench`, so a
service with its own `common` broke one of the two. Installed, Sluice is `sluice_inference` alone.

The fresh venv gets the wheel without its dependencies (installing them all again would take minutes): a
`.pth` file points it at this venv's site-packages, where an editable install keeps no package of ours
(its finder hook is a `.pth` there, which a path added this way does not run). So what the new venv can
import of Sluice comes from the wheel alone, and the old names must not be importable there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "sluice_inference"
OLD = ("common", "router", "worker", "cli", "bench")
MARKER = "a user's own common package"

PROBE = """
import importlib, importlib.util, json, sys
common = importlib.import_module("common")  # the user's package, not an import of ours
import sluice_inference
import sluice_inference.common.client
from sluice_inference.common.pb.inference import grpc_service_pb2
print(json.dumps({
    "marker": getattr(common, "MARKER", None),
    "package": sluice_inference.__file__,
    "client": sluice_inference.common.client.__file__,
    "importable": [n for n in sys.argv[1:] if importlib.util.find_spec(n) is not None],
}))
"""


def _run(argv: list[str | Path], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _copy_tree(dest: Path) -> None:
    """The checkout's files (links kept as links), so a stale build/ of the checkout cannot leak in."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
        check=True, capture_output=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, dest / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)


def _build_wheel(tmp: Path) -> Path:
    tree, wheels = tmp / "tree", tmp / "wheels"
    _copy_tree(tree)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", wheels, tree],
        cwd=tmp,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = wheels.glob("sluice_inference-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv holding the wheel and a user's `common`, and this venv's dependencies through a .pth."""
    home = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    installed = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        cwd=tmp,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp)
    site = Path(where.stdout.strip())
    assert not (site / "common").exists(), "the wheel took the top-level name `common`"
    (site / "common").mkdir()
    (site / "common" / "__init__.py").write_text(f'"""Not Sluice\'s."""\nMARKER = {MARKER!r}\n')
    (site / "zz_sluice_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return home


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One wheel built from this checkout for the module's tests."""
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_only_the_package_as_real_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        infos = archive.infolist()
    names = {info.filename for info in infos}
    tops = {name.split("/")[0] for name in names}
    assert PACKAGE in tops and all(top.endswith(".dist-info") for top in tops - {PACKAGE}), tops
    for needed in ("__init__.py", "common/client.py", "cli/main.py", "router/policy/core.py",
                   "worker/executor.py", "bench/loadgen.py", "common/pb/inference/grpc_service_pb2.py",
                   "common/pb/py.typed"):  # fmt: skip
        assert f"{PACKAGE}/{needed}" in names
    links = [info.filename for info in infos if (info.external_attr >> 16) & 0o170000 == 0o120000]
    assert links == [], "the wheel must hold the files, not the repository's links"


def test_installed_beside_a_user_common_package_both_import_and_sluice_runs(
    wheel: Path, tmp_path: Path
) -> None:
    home = _fresh_venv(tmp_path, wheel)
    work = tmp_path / "elsewhere"  # not the checkout: its folders must not be on the path
    work.mkdir()
    probe = _run([home / "bin" / "python", "-c", PROBE, *OLD], work)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["marker"] == MARKER, "`import common` must give the user's package"
    assert seen["importable"] == ["common"], "no old top-level name may come from the wheel"
    for key in ("package", "client"):
        assert Path(seen[key]).is_relative_to(home), f"{seen[key]} is not the installed copy"
    help_run = _run([home / "bin" / "sluice", "--help"], work)
    assert help_run.returncode == 0, help_run.stderr
    assert "usage: sluice" in help_run.stdout
