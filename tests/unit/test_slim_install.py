"""A slim install (`pip install sluice-inference`: the client library, the CLI and the router) works
without torch: their entry modules never import it, and the worker-only commands say which extra to add.

Each check runs in a fresh interpreter (this test process has torch loaded already); the second one makes
torch unimportable there, as it is in a slim install.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

from tests.support.triton_repo import TOY_YAML

ENTRY_MODULES = [
    "sluice_inference.router.main", "sluice_inference.common.client", "sluice_inference.cli.main",
    "sluice_inference.cli.commands", "sluice_inference.cli.admin_cmds", "sluice_inference.cli.bench_cmd",
    "sluice_inference.cli.sim_cmd", "sluice_inference.cli.cluster", "sluice_inference.cli.models_check",
    "sluice_inference.bench.loadgen", "sluice_inference.common.local_cluster",
]  # fmt: skip
HEAVY = ("torch", "onnxruntime", "onnx")

IMPORTED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "onnxruntime", "onnx"})))
"""

# Top-level modules the entry modules load, each with the distributions that may provide it.
PROVIDERS = """
import importlib, json, sys
from importlib.metadata import packages_distributions
already = {m.split(".")[0] for m in sys.modules}  # the interpreter's own start-up (site hooks)
for name in sys.argv[1:]:
    importlib.import_module(name)
ours = {"sluice_inference", "tests"}
tops = {m.split(".")[0] for m in sys.modules} - already - set(sys.stdlib_module_names) - ours
found = packages_distributions()
print(json.dumps({top: found[top] for top in sorted(tops) if top in found}))
"""
REPO = Path(__file__).resolve().parents[2]
# Imported when present, not needed: grpc loads grpc_tools (a dev dependency) if it is installed.
OPTIONAL = {"grpc_tools"}

WITHOUT_TORCH = """
import sys

class NoTorch:
    '''A slim install: torch (and ONNX Runtime) cannot be imported.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "onnxruntime", "onnx"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from sluice_inference.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, check=False)


def test_client_cli_and_router_entry_modules_never_import_torch() -> None:
    run = _python("-c", IMPORTED, *ENTRY_MODULES)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def _name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found, requirement
    return re.sub(r"[-_.]+", "-", found.group(0)).lower()


def _base_closure() -> set[str]:
    """What `pip install sluice-inference` brings: the base dependencies and theirs, without extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = [_name(r) for r in project["dependencies"]]
    closure: set[str] = set()
    while pending:
        name = pending.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        pending.extend(_name(r) for r in needs if "extra ==" not in r)
    return closure


def test_what_the_entry_modules_import_comes_with_the_base_install() -> None:
    run = _python("-c", PROVIDERS, *ENTRY_MODULES)
    assert run.returncode == 0, run.stderr
    closure = _base_closure()
    imported: dict[str, list[str]] = json.loads(run.stdout)
    missing = {
        top: dists
        for top, dists in imported.items()
        if top not in OPTIONAL and not {_name(d) for d in dists} & closure
    }
    assert missing == {}, "imported by the client, CLI or router but not a base dependency"


def test_without_torch_the_cli_works_and_worker_commands_name_the_extra(tmp_path: Path) -> None:
    assert _python("-c", WITHOUT_TORCH, "--help").returncode == 0
    (tmp_path / "toy" / "1").mkdir(parents=True)
    (tmp_path / "toy" / "config.yaml").write_text(json.dumps(TOY_YAML))
    (tmp_path / "peer" / "1").mkdir(parents=True)
    (tmp_path / "peer" / "1" / "model.pt").write_bytes(b"not loaded here")
    (tmp_path / "peer" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch" max_batch_size: 4 dynamic_batching {} '
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ] '
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]'
    )
    check = _python("-c", WITHOUT_TORCH, "models", "check", str(tmp_path))
    assert check.returncode == 0, check.stderr
    assert "toy v1: synthetic from config.yaml" in check.stdout
    assert "peer v1: torchscript from config.pbtxt" in check.stdout
    assert "load not tried: torch is not installed (pip install 'sluice-inference[worker]')" in check.stdout
    init = _python("-c", WITHOUT_TORCH, "models", "init", "--repository", str(tmp_path / "demo"))
    assert init.returncode == 1
    assert "sluice models: needs torch: pip install 'sluice-inference[worker]'" in init.stderr
