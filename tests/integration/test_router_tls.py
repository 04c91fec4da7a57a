"""TLS on the client port, with the official Triton client (`tritonclient.grpc`, `ssl=True`), which
runs in a subprocess because it cannot share a process with our stubs (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from sluice_inference.common.dev_certs import write_dev_certs
from sluice_inference.common.serving_settings import RouterSettings, TenantSettings
from sluice_inference.common.trust_settings import ServerTlsSettings
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

TENANTS = {"gold": TenantSettings(api_keys=[hash_api_key("gold-key")])}

TLS_CLIENT = """
import sys
import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException
url, ca, cert, key = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4] or None
client = tc.InferenceServerClient(
    url, ssl=True, root_certificates=ca, private_key=key, certificate_chain=cert
)
headers = {"authorization": "Bearer gold-key"}
try:
    assert client.is_server_live(client_timeout=10)
    x = tc.InferInput("x", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    result = client.infer("synthetic", [x], headers=headers, client_timeout=10)
except InferenceServerException as exc:
    print(exc.status(), exc.message())
    sys.exit(3)
print(result.as_numpy("y").shape)
"""


async def triton_over_tls(addr: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> str:
    """Run the Triton client script (without blocking the in-process router's loop); its output (exit 3
    and the status when the call failed)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TLS_CLIENT, addr, str(ca), str(cert or ""), str(key or ""),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode in (0, 3), err.decode()
    return out.decode().strip()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("router-certs")
    write_dev_certs(folder)
    return folder


async def test_triton_client_over_tls_and_mtls(make_router: MakeRouter, spawn: Spawn, certs: Path) -> None:
    tls = ServerTlsSettings(cert_file=certs / "router.pem", key_file=certs / "router-key.pem")
    mtls = ServerTlsSettings(
        cert_file=certs / "router.pem",
        key_file=certs / "router-key.pem",
        client_ca_file=certs / "ca.pem",
        require_client_cert=True,
    )
    routers = [
        await make_router(tenants=TENANTS, router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, tls=t))
        for t in (tls, mtls)
    ]
    spawn("w1")
    await eventually(lambda: all(accepting_workers(r) for r in routers), 60, "w1 accepted")
    plain, mutual = (f"localhost:{r.port}" for r in routers)
    ca = certs / "ca.pem"
    assert "(1, 16)" in await triton_over_tls(plain, ca)
    client_cert = (certs / "admin-client.pem", certs / "admin-client-key.pem")
    assert "(1, 16)" in await triton_over_tls(mutual, ca, *client_cert)
    assert "UNAVAILABLE" in await triton_over_tls(mutual, ca)  # no client certificate: no handshake
    other = certs.parent / "other-ca"
    write_dev_certs(other)
    assert "UNAVAILABLE" in await triton_over_tls(plain, other / "ca.pem")  # the router's CA is not trusted
