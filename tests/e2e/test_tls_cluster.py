"""`sluice up --tls`: the whole local cluster over TLS — client port (TLS), router ↔ workers (mTLS with
the development CA), etcd (TLS) — driven as a user would: `sluice certs dev`, the official Triton client
with `ssl=True`, `sluice health --tls`, the banner's add-a-router and drain commands, then Ctrl-C stops
every process."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sluice_inference.common.local_cluster import free_port
from tests.e2e.conftest import banner_line, interrupt, shell_command
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

TRITON_TLS = """
import sys
import numpy as np
import tritonclient.grpc as tc
client = tc.InferenceServerClient(sys.argv[1], ssl=True, root_certificates=sys.argv[2])
x = tc.InferInput("input", [2, 256], "FP32")
x.set_data_from_numpy(np.ones((2, 256), np.float32))
result = client.infer("mlp", [x], client_timeout=20)
print(result.as_numpy("output").shape)
"""


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sluice_inference.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_sluice_up_tls_end_to_end(demo_repo: Path, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    made = sluice("certs", "dev", str(certs))
    assert made.returncode == 0, made.stderr
    keys = sorted(certs.glob("*-key.pem"))
    assert keys and all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)

    port, metrics_port, etcd_port = free_port(), free_port(), free_port()
    log = tmp_path / "up.log"
    argv = [
        sys.executable, "-m", "sluice_inference.cli", "up", "--tls", "--certs", str(certs), "--repository",
        str(demo_repo), "--workers", "1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--etcd-port", str(etcd_port), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: b"Sluice is up" in log.read_bytes() or process.poll() is not None, 120, "sluice up"
        )
        assert process.poll() is None, log.read_text()
        ca = str(certs / "ca.pem")
        infer = subprocess.run(
            [sys.executable, "-c", TRITON_TLS, f"localhost:{port}", ca],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert infer.returncode == 0 and "(2, 10)" in infer.stdout, infer.stderr
        healthy = sluice("health", f"localhost:{port}", "--tls", "--ca", ca)
        assert healthy.returncode == 0 and "SERVING" in healthy.stdout, healthy.stderr
        plaintext = sluice("health", f"localhost:{port}", "--timeout", "2")
        assert plaintext.returncode == 2, plaintext.stdout  # a TLS port: no plaintext connection
        cli_infer = sluice(
            "infer", "--addr", f"localhost:{port}", "--tls", "--ca", ca, "--model", "mlp", "--random"
        )
        assert cli_infer.returncode == 0, cli_infer.stderr
        _grow_as_printed(log, ca)
    finally:
        interrupt(process, etcd_port, log)


def _grow_as_printed(log: Path, ca: str) -> None:
    """The banner's commands carry each role its certificates: an added router serves TLS and reaches the
    worker over mTLS; the drain line presents the operator's client certificate."""
    env, argv = shell_command(banner_line(log, "add a router"))
    port = free_port()
    argv[argv.index("--listen") + 1] = f"127.0.0.1:{port}"
    env = {**os.environ, **env}
    router = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        infer = ["infer", "--addr", f"localhost:{port}", "--tls", "--ca", ca, "--model", "mlp", "--random"]
        wait_until(lambda: sluice(*infer).returncode == 0, 60, "an answer through the added router")
    finally:
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0
    env, argv = shell_command(banner_line(log, "drain one"))
    assert "worker-1" in argv
    drained = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False
    )
    assert drained.returncode == 0, drained.stderr
