"""What deploy/ promises about who can talk to whom (docs/security.md, docs/kubernetes.md "TLS"): network
policies that let only routers reach workers and only routers and workers reach etcd; etcd over TLS with
client certificates whose common names are the users etcd-rbac.sh gives least privilege; TLS on the
client port; mTLS on the hop with a certificate per worker id. Dev is plaintext on purpose, and says so
with `--dev`. Each check has a negative case."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest

from tests.deploy import crossrefs
from tests.deploy.rendering import DEPLOY, OVERLAYS, Obj, Rendered, pod_labels, pod_spec, selector_matches
from tests.deploy.sluice_cli import container_invocations, effective_config, main_args, parse

PROD = ("prod-gpu", "prod-gpu-keda")
ANYONE = "anyone"


def _workload(rendered: Rendered, component: str) -> Obj:
    found = [w for w in rendered.workloads() if pod_labels(w).get("app.kubernetes.io/component") == component]
    assert len(found) == 1, component
    return found[0]


def _main(rendered: Rendered, component: str) -> tuple[Obj, Obj]:
    workload = _workload(rendered, component)
    return workload, pod_spec(workload)["containers"][0]


def reachable(rendered: Rendered, component: str, port: str) -> set[str]:
    """Components whose pods may open `port` (a port name) of `component`'s pods, or {ANYONE}."""
    labels = pod_labels(_workload(rendered, component))
    policies = [
        p for p in rendered.of_kind("NetworkPolicy") if selector_matches(p["spec"]["podSelector"], labels)
    ]
    if not policies:
        return {ANYONE}
    sources: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return {ANYONE}
            for peer in rule["from"]:
                selector = peer.get("podSelector")
                if selector is None or "namespaceSelector" in peer or "ipBlock" in peer:
                    return {ANYONE}
                sources |= {
                    pod_labels(w)["app.kubernetes.io/component"]
                    for w in rendered.workloads()
                    if selector_matches(selector, pod_labels(w))
                }
    return sources


EXPECTED_REACH = {
    ("etcd", "client"): {"router", "worker"},
    ("etcd", "peer"): {"etcd"},
    ("worker", "grpc"): {"router"},
    ("worker", "metrics"): {ANYONE},
    ("router", "grpc"): {ANYONE},
    ("redis", "redis"): {"router"},
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_the_expected_peers_in(overlays: dict[str, Rendered], overlay: str) -> None:
    rendered = overlays[overlay]
    assert {key: reachable(rendered, *key) for key in EXPECTED_REACH} == EXPECTED_REACH


def test_the_reach_check_sees_an_open_etcd(overlays: dict[str, Rendered]) -> None:
    broken = Rendered("broken", copy.deepcopy(overlays["prod-gpu"].objects))
    del broken.get("NetworkPolicy", "sluice-etcd")["spec"]["ingress"][0]["from"]
    assert reachable(broken, "etcd", "client") == {ANYONE}
    broken.get("NetworkPolicy", "sluice-worker")["spec"]["ingress"][0]["ports"][0]["port"] = "grcp"
    assert any("grcp" in p for p in crossrefs.network_policies(broken))


def _mounted_secret(rendered: Rendered, workload: Obj, container: Obj, path: Path | None) -> Obj:
    """The cert-manager Certificate behind the Secret volume mounted where `path` lies."""
    assert path is not None
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in container["volumeMounts"]:
        if PurePosixPath(path).parent == PurePosixPath(mount["mountPath"]):
            secret = volumes[mount["name"]]["secret"]["secretName"]
            return next(c for c in rendered.of_kind("Certificate") if c["spec"]["secretName"] == secret)
    raise AssertionError(f"nothing mounted at {path}")


def rbac_grants() -> dict[str, set[tuple[str, str]]]:
    """(permission, folder) per role, as deploy/base/etcd-rbac.sh grants them ('' is the whole prefix)."""
    grants: dict[str, set[tuple[str, str]]] = {}
    for line in (DEPLOY / "base" / "etcd-rbac.sh").read_text().splitlines():
        words = shlex.split(line.split("#", 1)[0]) if not line.lstrip().startswith("#") else []
        if words[:1] == ["probe"]:
            grants.setdefault(words[1], set()).add(("read", "(the prefix key)"))
        elif words[:1] == ["grant"]:
            grants.setdefault(words[1], set()).add((words[2], words[3]))
        elif words[:3] == ["ensure", "role", "grant-permission"] and not words[3].startswith("$"):
            grants.setdefault(words[3], set()).add((words[4], words[5].replace('"$PREFIX"', "")))
    return grants


def test_etcd_rbac_gives_each_component_only_its_prefixes() -> None:
    assert rbac_grants() == {
        "sluice-router": {
            ("read", "(the prefix key)"),
            ("read", "workers/"),
            ("read", "tenants/"),
            ("readwrite", "routers/"),
        },
        "sluice-worker": {("read", "(the prefix key)"), ("readwrite", "workers/")},
        "sluice-operator": {("read", "$PREFIX"), ("readwrite", "tenants/")},
    }


@pytest.mark.parametrize("overlay", PROD)
def test_etcd_serves_tls_and_knows_each_client_by_its_certificate(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    rendered = overlays[overlay]
    etcd = pod_spec(rendered.get("StatefulSet", "sluice-etcd"))["containers"][0]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in etcd["args"])
    assert flags["client-cert-auth"] == flags["peer-client-cert-auth"] == "true"
    for name in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-cluster"):
        assert "http://" not in flags[name], name
    server = next(c for c in rendered.of_kind("Certificate") if c["metadata"]["name"] == "sluice-etcd-server")
    assert {"server auth", "client auth"} <= set(server["spec"]["usages"])  # peers are clients too
    for component, user in (("router", "sluice-router"), ("worker", "sluice-worker")):
        workload, container = _main(rendered, component)
        settings = effective_config(rendered, workload, container, tmp_path).etcd
        assert settings.ca_file is not None and settings.username is None
        hosts = {e.rsplit(":", 1)[0] for e in settings.endpoints}
        assert hosts <= set(server["spec"]["dnsNames"])
        certificate = _mounted_secret(rendered, workload, container, settings.cert_file)
        assert certificate["spec"]["commonName"] == user and user in rbac_grants()
        assert "client auth" in certificate["spec"]["usages"]


@pytest.mark.parametrize("overlay", PROD)
def test_the_client_port_serves_tls_and_the_probes_verify_it(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    rendered = overlays[overlay]
    workload, container = _main(rendered, "router")
    tls = effective_config(rendered, workload, container, tmp_path).router.tls
    assert tls.enabled
    certificate = _mounted_secret(rendered, workload, container, tls.cert_file)
    assert (
        "server auth" in certificate["spec"]["usages"] and "127.0.0.1" in certificate["spec"]["ipAddresses"]
    )
    for service in ("sluice-router", "sluice-router-headless"):
        assert service in certificate["spec"]["dnsNames"]
    probes = [i.args for where, i in container_invocations(workload, container) if where != "main"]
    assert probes and all(args is not None and args.tls and args.ca for args in probes)


@pytest.mark.parametrize("overlay", PROD)
def test_the_hop_is_mtls_with_a_certificate_per_worker_id(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    rendered = overlays[overlay]
    router, router_main = _main(rendered, "router")
    hop = effective_config(rendered, router, router_main, tmp_path).cluster
    assert hop.tls and hop.token_value() is None
    router_cert = _mounted_secret(rendered, router, router_main, hop.cert_file)
    assert (
        router_cert["spec"]["dnsNames"] == ["router.sluice"]
        and "client auth" in router_cert["spec"]["usages"]
    )
    worker, worker_main = _main(rendered, "worker")
    config = effective_config(rendered, worker, worker_main, tmp_path)
    assert config.cluster.tls and not config.worker.dev
    volumes = {v["name"]: v for v in pod_spec(worker)["volumes"]}
    mount = next(
        m
        for m in worker_main["volumeMounts"]
        if PurePosixPath(str(config.cluster.cert_file)).parent == PurePosixPath(m["mountPath"])
    )
    attributes = volumes[mount["name"]]["csi"]["volumeAttributes"]
    assert attributes["csi.cert-manager.io/dns-names"] == "${POD_NAME}.worker.sluice"
    assert main_args(worker, worker_main).worker_id == "$(POD_NAME)"  # the id its certificate names
    assert rendered.has("Issuer", attributes["csi.cert-manager.io/issuer-name"])
    assert "*" not in attributes["csi.cert-manager.io/dns-names"]


def test_dev_is_plaintext_on_purpose_and_says_so(overlays: dict[str, Rendered], tmp_path: Path) -> None:
    rendered = overlays["dev"]
    worker, worker_main = _main(rendered, "worker")
    config = effective_config(rendered, worker, worker_main, tmp_path)
    assert config.worker.dev and not config.cluster.tls and not config.router.tls.enabled
    assert not rendered.of_kind("Certificate")
    assert parse(["worker", "--dev"], "test").args is not None


def test_no_overlay_ships_a_placeholder_or_the_dev_token_outside_dev() -> None:
    for overlay in OVERLAYS:
        for env_file in (DEPLOY / "overlays" / overlay).glob("*.env"):
            if overlay != "dev":
                assert "SLUICE_CLUSTER__TOKEN" not in env_file.read_text(), env_file
    assert not (DEPLOY / "base" / "cluster-token.env").exists()
    assert re.search(
        r"sluice-dev-cluster-token", (DEPLOY / "overlays" / "dev" / "cluster-token.env").read_text()
    )
