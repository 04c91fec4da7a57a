"""A Triton model repository, served unchanged by `sluice up --repository DIR` (the `make run` path),
answers the official Triton client exactly as its artifacts answer in-process.

The repository (tests/support/triton_repo.py) holds a TorchScript MLP named Triton's way (`INPUT__0` →
`OUTPUT__0`, bound by position to `forward(self, x)`) with two served versions, an ONNX MLP of whose three
versions `version_policy` serves only the latest, both with `dynamic_batching`, and a Sluice `config.yaml`
model beside them. tritonclient runs in a subprocess (its descriptors cannot share a process with ours).
Requests go one at a time, so each batch holds one request and the cluster's answer must equal, bit for
bit, the artifact run alone on one thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import Cluster, local_cluster
from tests.support.triton_repo import WIDTH_IN, reference, write_triton_repository

pytestmark = pytest.mark.e2e

# (model, version asked for ("" = latest), rows)
CASES = [
    ("peer_mlp", "1", 1),
    ("peer_mlp", "1", 3),
    ("peer_mlp", "2", 2),
    ("onnx_mlp", "", 1),
    ("onnx_mlp", "", 8),
]

TRITON_CLIENT = """
import json, sys
import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

addr, out_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = tc.InferenceServerClient(addr)
found = {"ready": {}, "metadata": {}, "errors": {}}
for model in ("peer_mlp", "onnx_mlp", "toy"):
    found["ready"][model] = client.is_model_ready(model)
meta = client.get_model_metadata("peer_mlp", "2")
found["metadata"]["peer_mlp"] = [[t.name, t.datatype, list(t.shape)] for t in (*meta.inputs, *meta.outputs)]
for i, (model, version, rows) in enumerate(cases):
    x = np.random.default_rng(i).standard_normal((rows, 16)).astype(np.float32)
    name_in, name_out = ("INPUT__0", "OUTPUT__0") if model == "peer_mlp" else ("input", "output")
    tensor = tc.InferInput(name_in, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor], model_version=version, outputs=[tc.InferRequestedOutput(name_out)])
    np.save(f"{out_dir}/{i}.npy", result.as_numpy(name_out))
    found["metadata"][f"{i}"] = result.get_response().model_version
tensor = tc.InferInput("input", [1, 16], "FP32")
tensor.set_data_from_numpy(np.zeros((1, 16), np.float32))
answers = [client.infer("onnx_mlp", [tensor]).get_response() for _ in range(2)]
found["cache"] = [a.parameters["sluice_cache"].string_param for a in answers]
try:
    client.infer("onnx_mlp", [tensor], model_version="1")
except InferenceServerException as exc:
    found["errors"]["onnx_mlp v1"] = exc.status()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def triton_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    repository = write_triton_repository(tmp_path_factory.mktemp("triton-repo"))
    with local_cluster(repository, tmp_path_factory.mktemp("triton-logs"), "--workers", "1") as running:
        yield running


def test_triton_client_gets_what_the_artifacts_answer_in_process(
    triton_cluster: Cluster, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT, triton_cluster.addr, str(tmp_path), json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["ready"] == {"peer_mlp": True, "onnx_mlp": True, "toy": True}
    assert found["metadata"]["peer_mlp"] == [["INPUT__0", "FP32", [-1, 16]], ["OUTPUT__0", "FP32", [-1, 4]]]
    # version_policy latest 1 of {1, 2, 3}: only version 3 is served, and it answers "latest".
    assert found["errors"] == {"onnx_mlp v1": "StatusCode.NOT_FOUND"}
    # response_cache { enable: true }: the second identical request is answered from the router's cache.
    assert found["cache"] == ["miss", "hit"]
    for i, (model, version, rows) in enumerate(CASES):
        served = version or "3"
        assert found["metadata"][str(i)] == served
        x = np.random.default_rng(i).standard_normal((rows, WIDTH_IN)).astype(np.float32)
        got = np.load(tmp_path / f"{i}.npy")
        np.testing.assert_array_equal(got, reference(triton_cluster.repository, model, int(served), x))


def test_the_load_warning_names_what_is_not_applied(triton_cluster: Cluster) -> None:
    log = (triton_cluster.log_dir / "worker-1.log").read_text()
    warnings = [line for line in log.splitlines() if "not applied" in line]
    assert len(warnings) == 1, warnings  # one warning for peer_mlp (both versions), none for the others
    for named in ("peer_mlp", "instance_group count 2", "parameters", "preferred_batch_size [4]"):
        assert named in warnings[0]
