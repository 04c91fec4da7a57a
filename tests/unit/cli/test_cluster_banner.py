"""What `sluice up` prints once it is up (cli/cluster.py): where things listen, and the exact commands to
try, to add a worker or a router and to drain a worker, with this run's etcd, credentials and config.
tests/e2e/test_local_cluster.py runs the printed commands against a live cluster."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from sluice_inference.cli.cluster import banner
from sluice_inference.cli.main import _build_parser
from sluice_inference.common.local_cluster import ClusterEnv

REPO = Path(__file__).resolve().parents[3]
GROW = ("add a worker", "add a router", "drain one")


def printed(*flags: str, run_dir: Path) -> dict[str, list[str]]:
    """The banner of `sluice up FLAGS`: each command's words, by its label (a Try line by its subcommand)."""
    args = _build_parser().parse_args(["up", *flags])
    text = banner(args, ClusterEnv(args, run_dir), 3.2)
    assert text.startswith("Sluice is up in 3.2 s:")
    lines = {label: shlex.split(line) for label, line in re.findall(r"^  ([a-z ]+): +(.+)$", text, re.M)}
    tries = text.split("\nTry:\n", 1)[1].split("\nGrow it", 1)[0]
    for line in tries.splitlines():
        words = shlex.split(line)
        lines[words[words.index("sluice") + 1]] = words
    assert set(lines) == {*GROW, "infer", "health", "workers"}, text
    return lines


def environment(words: list[str]) -> dict[str, str]:
    """A printed command's environment assignments; what follows `sluice` must parse."""
    at = words.index("sluice")
    _build_parser().parse_args(words[at + 1 :])
    return dict(word.split("=", 1) for word in words[:at])


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_a_token_cluster_prints_how_to_grow_it(tmp_path: Path) -> None:
    lines = printed("--port", "18001", "--etcd-port", "12379", "--repository", "models", run_dir=tmp_path)
    for label in GROW:
        assert environment(lines[label]) == {"SLUICE_CLUSTER__TOKEN_FILE": str(tmp_path / "cluster-token")}
        assert flag(lines[label], "--etcd") == "127.0.0.1:12379"
    assert lines["add a worker"][1:] == [
        "sluice",
        "worker",
        "--etcd",
        "127.0.0.1:12379",
        "--repository",
        "models",
    ]
    router = lines["add a router"]
    assert flag(router, "--listen").startswith("127.0.0.1:") and flag(router, "--listen") != "127.0.0.1:18001"
    assert flag(router, "--metrics-port") == "0"  # a free one: the cluster's router has 8002
    assert lines["drain one"][1:4] == ["sluice", "drain", "worker-2"]
    assert lines["infer"] == ["sluice", "infer", "--addr", "localhost:18001", "--model", "mlp", "--random"]
    assert lines["health"] == ["sluice", "health", "localhost:18001"]
    assert lines["workers"] == ["sluice", "workers", "--etcd", "127.0.0.1:12379"]
    for name in ("infer", "health", "workers"):
        assert environment(lines[name]) == {}


def test_default_ports_keep_the_commands_to_try_short(tmp_path: Path) -> None:
    lines = printed(run_dir=tmp_path)
    assert lines["infer"] == ["sluice", "infer", "--model", "mlp", "--random"]
    assert lines["workers"] == ["sluice", "workers"]


def test_a_config_goes_with_every_added_process(tmp_path: Path) -> None:
    config = str(REPO / "bench" / "scenarios" / "cluster-tenants.yaml")
    lines = printed("--config", config, run_dir=tmp_path)
    for label in GROW:
        assert lines[label][-2:] == ["--config", config]
        environment(lines[label])


def test_a_tls_cluster_prints_each_role_its_certificates(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    lines = printed("--tls", "--certs", str(certs), run_dir=tmp_path / "run")
    worker, router, drain = (environment(lines[label]) for label in GROW)
    ca = str(certs / "ca.pem")
    for env in (worker, router, drain):
        assert env["SLUICE_ETCD__CA_FILE"] == env["SLUICE_CLUSTER__CA_FILE"] == ca
        assert "SLUICE_CLUSTER__TOKEN_FILE" not in env
    assert worker["SLUICE_CLUSTER__CERT_FILE"] == str(certs / "workers" / "worker-3.pem")  # its own id's
    assert flag(lines["add a worker"], "--worker-id") == "worker-3"
    assert router["SLUICE_CLUSTER__CERT_FILE"] == str(certs / "router-client.pem")
    assert router["SLUICE_ROUTER__TLS__CERT_FILE"] == str(certs / "router.pem")
    assert drain["SLUICE_CLUSTER__CERT_FILE"] == str(certs / "admin-client.pem")
    assert lines["infer"] == ["sluice", "infer", "--tls", "--ca", ca, "--model", "mlp", "--random"]
    assert lines["health"] == ["sluice", "health", "--tls", "--ca", ca, "localhost:8001"]
    assert environment(lines["workers"]) == {"SLUICE_ETCD__CA_FILE": ca}
