"""The whole path through the CLI's local cluster: correctness under concurrency, batching, drain
under load, the CLI commands, the commands `sluice up` prints to grow the cluster, and an unmodified
official Triton client.

Tests run in file order on one cluster; the drain test stops a worker, so it comes last.

Regime: the loads here are ones the router absorbs, never overload. How many calls are in flight at once
is derived from the router path's rate measured at the start (`router_speed`, bench/calibration.py), so
that no call waits near the front door's bound before the router's code takes it (`in_flight`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.calibration import RouterSpeed, measure_router, one_row_request
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.e2e.conftest import Cluster, shell_command
from tests.support.processes import find_pids, wait_until

pytestmark = pytest.mark.e2e

IN_FLIGHT_WAIT_S = 0.1
"""Calls in flight at once are at most what the router path serves in this long, well under the front
door's bound (`router.door_max_delay_ms`, 250 ms): the door refuses part of the calls once they have waited
longer for a while (`door_sustain_s`), which is overload, not what these tests are about. With the CPU
limited, 500 calls at once opened it for the last 48, and 32 in flight during the drain for 204."""


def _mlp_request(row: np.ndarray) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(row.astype("<f4").reshape(1, 256).tobytes())
    return request


async def _infer_all(addr: str, rows: np.ndarray, concurrency: int) -> list[np.ndarray | str]:
    """Send one request per row with at most `concurrency` in flight; outputs or error strings."""
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def one(row: np.ndarray) -> np.ndarray | str:
            async with limit:
                try:
                    response = await stub.ModelInfer(_mlp_request(row), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"
                return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(10)

        return await asyncio.gather(*(one(row) for row in rows))


def _reference(cluster: Cluster, rows: np.ndarray) -> np.ndarray:
    """The model artifact run locally, outside Sluice."""
    module = torch.export.load(str(cluster.repository / "mlp" / "1" / "model.pt2")).module()
    with torch.inference_mode():
        chunks = [module(input=torch.from_numpy(rows[i : i + 50])) for i in range(0, len(rows), 50)]
    return torch.cat(chunks).numpy()


def _batch_histogram(cluster: Cluster) -> tuple[float, float]:
    """(batches, rows) the router has sent for mlp, from its /metrics."""
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    )
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_router_batch_size":
            samples = {s.name: s.value for s in family.samples if s.labels.get("model") == "mlp"}
            return samples.get("sluice_router_batch_size_count", 0.0), samples.get(
                "sluice_router_batch_size_sum", 0.0
            )
    raise AssertionError("sluice_router_batch_size not exported")


def in_flight(speed: RouterSpeed, most: int) -> int:
    """How many calls to keep in flight: `most`, or fewer where the router path is slow (IN_FLIGHT_WAIT_S)."""
    return max(1, min(most, int(speed.rps * IN_FLIGHT_WAIT_S)))


@pytest.fixture(scope="module")
def router_speed(cluster: Cluster) -> RouterSpeed:
    """What the router path serves flat out now (mlp, one row, past the result cache)."""
    [router_pid] = find_pids("--router-id router-1", f"127.0.0.1:{cluster.etcd_port}")
    request = one_row_request("mlp", "input", 256)
    speed = asyncio.run(measure_router(cluster.addr, request, router_pid=router_pid))
    print(f"calibration: {speed.describe()}")
    return speed


def test_500_requests_match_the_artifact_and_are_batched(cluster: Cluster, router_speed: RouterSpeed) -> None:
    rows = np.random.default_rng(7).standard_normal((500, 256)).astype(np.float32)
    concurrency = in_flight(router_speed, 500)
    before_batches, before_rows = _batch_histogram(cluster)
    outputs = asyncio.run(_infer_all(cluster.addr, rows, concurrency=concurrency))
    errors = [o for o in outputs if isinstance(o, str)]
    assert not errors, (concurrency, Counter(errors))
    np.testing.assert_allclose(np.stack(outputs), _reference(cluster, rows), rtol=0, atol=1e-5)
    batches, total_rows = _batch_histogram(cluster)
    assert total_rows - before_rows == 500
    assert batches - before_batches < 500, "no batch held more than one request"


def sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (with extra environment variables)."""
    return subprocess.run(
        [sys.executable, "-m", "sluice_inference.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_stream_infer_answers_every_request_in_completion_order(cluster: Cluster) -> None:
    rows = np.random.default_rng(5).standard_normal((20, 256)).astype(np.float32)

    async def stream() -> list[kserve.ModelStreamInferResponse]:
        requests = [_mlp_request(row) for row in rows]
        for index, request in enumerate(requests):
            request.id = str(index)
        bad = kserve.ModelInferRequest(model_name="mlp", id="bad")
        bad.inputs.add(name="input", datatype="FP32", shape=[1, 3])
        bad.raw_input_contents.append(b"\0" * 12)
        async with grpc.aio.insecure_channel(cluster.addr) as channel:
            call = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([*requests, bad]))
            return [response async for response in call]

    responses = asyncio.run(stream())
    by_id = {r.infer_response.id: r for r in responses}
    assert len(responses) == 21 and set(by_id) == {*map(str, range(20)), "bad"}
    assert by_id["bad"].error_message.startswith("INVALID_ARGUMENT")
    outputs = [np.frombuffer(by_id[str(i)].infer_response.raw_output_contents[0], "<f4") for i in range(20)]
    np.testing.assert_allclose(np.stack(outputs), _reference(cluster, rows), atol=1e-5)


def test_cli_health_workers_and_infer(cluster: Cluster) -> None:
    assert sluice("health", cluster.addr).returncode == 0
    assert sluice("health", "127.0.0.1:1").returncode == 2
    listing = sluice("workers", "--etcd", f"127.0.0.1:{cluster.etcd_port}")
    assert listing.returncode == 0, listing.stderr
    assert "worker-1" in listing.stdout and "worker-2" in listing.stdout and "mlp:1" in listing.stdout
    via_router = sluice("workers", "--addr", cluster.addr)
    assert via_router.returncode == 0 and "mlp:1" in via_router.stdout and "BUSY%" in via_router.stdout
    top = sluice("top", "--addr", cluster.addr, "--once")
    assert top.returncode == 0 and "LANE" in top.stdout and "worker-1" in top.stdout
    tenants = sluice("tenants", "--addr", cluster.addr)
    assert tenants.returncode == 0 and "anonymous" in tenants.stdout
    inferred = sluice("infer", "--model", "mlp", "--random", "--addr", cluster.addr)
    assert inferred.returncode == 0, inferred.stderr
    assert "version 1" in inferred.stdout and "batch size" in inferred.stdout and "latency" in inferred.stdout
    missing = sluice("infer", "--model", "nope", "--random", "--addr", cluster.addr)
    assert missing.returncode == 3 and "NOT_FOUND" in missing.stderr


TRITON_CLIENT_SCRIPT = """
import sys
import numpy as np
import tritonclient.grpc as tc
client = tc.InferenceServerClient(sys.argv[1])
assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
meta = client.get_model_metadata("mlp")
assert meta.name == "mlp" and list(meta.inputs[0].shape) == [-1, 256], meta
x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
tensor = tc.InferInput("input", [2, 256], "FP32")
tensor.set_data_from_numpy(x)
result = client.infer("mlp", [tensor], outputs=[tc.InferRequestedOutput("output")])
np.save(sys.argv[2], np.stack([x[:, :10], result.as_numpy("output")]))
"""


def test_official_triton_client_works_unchanged(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "result.npy"
    run = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT_SCRIPT, cluster.addr, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    x_head, output = np.load(out)
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_array_equal(x_head, x[:, :10])
    np.testing.assert_allclose(output, _reference(cluster, x), atol=1e-5)


def _start_printed(cluster: Cluster, label: str, log: Path, **replace: str) -> subprocess.Popen[bytes]:
    """Run the command `sluice up` printed after `label:`, as a user pasting it would (with `replace`
    swapping flag values, e.g. a listen port that is free now)."""
    env, argv = shell_command(cluster.banner_line(label))
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})


def test_the_banner_commands_add_a_worker_and_a_router(cluster: Cluster, tmp_path: Path) -> None:
    etcd = f"127.0.0.1:{cluster.etcd_port}"
    assert etcd in cluster.banner_line("add a worker") and etcd in cluster.banner_line("add a router")
    router_addr = f"127.0.0.1:{free_port()}"  # the printed port was free when printed; this one is now
    worker = _start_printed(cluster, "add a worker", tmp_path / "worker.log")
    router = _start_printed(cluster, "add a router", tmp_path / "router.log", **{"--listen": router_addr})
    try:

        def joined() -> bool:
            listing = sluice("workers", "--addr", router_addr)
            return listing.returncode == 0 and "3 worker(s)" in listing.stdout

        wait_until(joined, 120, "the added router to see the added worker beside worker-1 and worker-2")
        assert worker.poll() is None and router.poll() is None
        listing = sluice("workers", "--etcd", etcd)
        assert "3 worker(s)" in listing.stdout, listing.stdout
        assert sluice("health", router_addr).returncode == 0
        answered = sluice("infer", "--model", "mlp", "--random", "--addr", router_addr)
        assert answered.returncode == 0, answered.stderr
    finally:
        codes = [_stop(added) for added in (worker, router)]
    assert codes == [0, 0], (tmp_path / "worker.log").read_text() + (tmp_path / "router.log").read_text()
    wait_until(
        lambda: "2 worker(s)" in sluice("workers", "--etcd", etcd).stdout, 20, "the added worker to leave"
    )


def _stop(process: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM (a worker drains, a router deregisters), then SIGKILL if it takes over a minute."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
        return None


def test_sigterm_on_a_worker_during_load_loses_no_request(
    cluster: Cluster, router_speed: RouterSpeed
) -> None:
    rows = np.random.default_rng(11).standard_normal((3000, 256)).astype(np.float32)
    [pid] = find_pids("--worker-id worker-2", f"127.0.0.1:{cluster.etcd_port}")

    async def load_and_drain() -> list[np.ndarray | str]:
        load = asyncio.create_task(_infer_all(cluster.addr, rows, concurrency=in_flight(router_speed, 32)))
        await asyncio.sleep(0.3)
        assert not load.done(), "load finished before the drain started; send more requests"
        os.kill(pid, signal.SIGTERM)  # a drain, as Kubernetes does before deleting a pod
        return await load

    outputs = asyncio.run(load_and_drain())
    errors = [o for o in outputs if isinstance(o, str)]
    assert not errors, Counter(errors)
    np.testing.assert_allclose(np.stack(outputs), _reference(cluster, rows), atol=1e-5)
    wait_until(
        lambda: not find_pids("--worker-id worker-2", f"127.0.0.1:{cluster.etcd_port}"), 30, "worker-2 exit"
    )
    wait_until(
        lambda: "worker-2 exited with 0" in (cluster.log_dir / "up.log").read_text(), 5, "sluice up to report"
    )


def test_sluice_drain_removes_the_last_worker_cleanly(cluster: Cluster) -> None:
    etcd = f"127.0.0.1:{cluster.etcd_port}"
    refused = sluice("drain", "worker-1", "--etcd", etcd)
    assert refused.returncode == 3 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    drained = sluice("drain", "worker-1", "--etcd", etcd, "--wait", "20", env=cluster.token_env())
    assert drained.returncode == 0, drained.stderr
    wait_until(
        lambda: "worker-1 exited with 0" in (cluster.log_dir / "up.log").read_text(), 20, "worker-1 exit"
    )
    listing = sluice("workers", "--etcd", etcd)
    assert "0 worker(s)" in listing.stdout
    assert sluice("health", cluster.addr).returncode == 4  # router alive, nothing to serve with
