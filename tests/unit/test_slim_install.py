"""A slim install (`pip install sluice-inference`: the client library, the CLI and the router) works
without torch: their entry modules never import it, and the worker-only commands say which extra to add.

Each check runs in a fresh interpreter (this test process has torch loaded already); the second one makes
torch unimportable there, as it is in a slim install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.triton_repo import TOY_YAML

ENTRY_MODULES = [
    "router.main", "common.client", "cli.main", "cli.commands", "cli.admin_cmds", "cli.bench_cmd",
    "cli.sim_cmd", "cli.cluster", "cli.models_check", "bench.loadgen", "common.local_cluster",
]  # fmt: skip
HEAVY = ("torch", "onnxruntime", "onnx")

IMPORTED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "onnxruntime", "onnx"})))
"""

WITHOUT_TORCH = """
import sys

class NoTorch:
    '''A slim install: torch (and ONNX Runtime) cannot be imported.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "onnxruntime", "onnx"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, check=False)


def test_client_cli_and_router_entry_modules_never_import_torch() -> None:
    run = _python("-c", IMPORTED, *ENTRY_MODULES)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


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
