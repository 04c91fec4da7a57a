"""deploy/ renders, passes the Kubernetes schemas, and its objects agree with each other and with Sluice.

Why: nothing here runs a cluster, so every promise the manifests make (a probe that calls a real command,
a grace period longer than the drain, a Service that reaches its pods, one image per role) is checked by
reading the rendered objects. Each overlay is rendered by the real kustomize in kubectl (see rendering.py);
each check also has a negative case, so a checker that silently accepts everything fails too.
"""

from __future__ import annotations

import copy
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from sluice_inference.common.config import ConfigError
from sluice_inference.common.dev_token import DEV_CLUSTER_TOKEN, refuse_dev_token
from tests.deploy import crossrefs, schemas
from tests.deploy.rendering import (
    DEPLOY,
    NAMESPACE,
    OVERLAYS,
    Obj,
    Rendered,
    containers,
    pod_spec,
    ref,
)
from tests.deploy.sluice_cli import (
    all_invocations,
    container_invocations,
    effective_config,
    exec_commands,
    handler_commands,
    host_of,
    is_sluice,
    main_args,
    parse,
    port_of,
)

PROD = ("prod-gpu", "prod-gpu-keda")
CLUSTER_SCOPED = frozenset({"Namespace"})


def _container(rendered: Rendered, kind: str, name: str, container: str) -> tuple[Obj, Obj]:
    workload = rendered.get(kind, name)
    for candidate in containers(pod_spec(workload)):
        if candidate["name"] == container:
            return workload, candidate
    raise KeyError(f"{ref(workload)} has no container {container}")


def _router(rendered: Rendered) -> tuple[Obj, Obj]:
    return _container(rendered, "Deployment", "sluice-router", "router")


def _worker(rendered: Rendered) -> tuple[Obj, Obj]:
    return _container(rendered, "Deployment", "sluice-worker", "worker")


def _port(container: Obj, name: str) -> int:
    for port in container.get("ports", []):
        if port.get("name") == name:
            number: int = port["containerPort"]
            return number
    raise KeyError(f"container {container['name']} has no port named {name}")


def test_every_overlay_and_component_is_rendered() -> None:
    """A new overlay or component must join OVERLAYS, or its objects would go unvalidated."""
    overlay_dirs = {p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()}
    assert overlay_dirs == set(OVERLAYS)
    used: set[Path] = set()
    for overlay in OVERLAYS:
        used |= _components(DEPLOY / "overlays" / overlay)
    assert used == {p.resolve() for p in (DEPLOY / "components").iterdir() if p.is_dir()}


def _components(directory: Path) -> set[Path]:
    """Components a kustomization uses, directly or through the kustomizations it builds on."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    found = {(directory / c).resolve() for c in kustomization.get("components", [])}
    for resource in kustomization.get("resources", []):
        if (directory / resource / "kustomization.yaml").is_file():
            found |= _components((directory / resource).resolve())
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_system(overlays: dict[str, Rendered], overlay: str) -> None:
    rendered = overlays[overlay]
    for kind, name in [
        ("Namespace", NAMESPACE),
        ("StatefulSet", "sluice-etcd"),
        ("Deployment", "sluice-redis"),
        ("Deployment", "sluice-router"),
        ("Service", "sluice-router-headless"),
        ("PodDisruptionBudget", "sluice-router"),
        ("Deployment", "sluice-worker"),
    ]:
        assert rendered.has(kind, name), f"{overlay}: {kind}/{name} missing"
    assert rendered.get("Service", "sluice-router-headless")["spec"]["clusterIP"] == "None"
    secrets = 2 if overlay == "dev" else 1  # API keys, and dev's published hop token (prod: mTLS)
    assert len(rendered.of_kind("ConfigMap")) >= 1 and len(rendered.of_kind("Secret")) == secrets
    scalers = {o["kind"] for o in rendered.objects} & {"HorizontalPodAutoscaler", "ScaledObject"}
    expected = {"dev": set(), "prod-gpu": {"HorizontalPodAutoscaler"}, "prod-gpu-keda": {"ScaledObject"}}
    assert scalers == expected[overlay]
    if overlay in PROD:
        for kind in ("ServiceMonitor", "PrometheusRule"):
            assert rendered.of_kind(kind), f"{overlay}: no {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_its_schema(overlays: dict[str, Rendered], overlay: str) -> None:
    found = [p for obj in overlays[overlay].objects for p in schemas.problems(obj)]
    assert found == []


def test_schema_validation_rejects_broken_objects(overlays: dict[str, Rendered]) -> None:
    deployment = copy.deepcopy(overlays["dev"].get("Deployment", "sluice-router"))
    pod_spec(deployment)["terminationGracePeriod"] = 60  # a misspelt field the API server would drop
    assert any("terminationGracePeriod" in p for p in schemas.problems(deployment))

    wrong_type = copy.deepcopy(overlays["dev"].get("Deployment", "sluice-router"))
    wrong_type["spec"]["replicas"] = "three"
    assert schemas.problems(wrong_type)

    scaled = copy.deepcopy(overlays["prod-gpu-keda"].get("ScaledObject", "sluice-worker"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # KEDA wants strings here
    scaled["spec"]["minReplicas"] = 2  # the field is minReplicaCount
    found = schemas.problems(scaled)
    assert any("threshold" in p for p in found) and any("minReplicas" in p for p in found)

    unknown = {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "g"}}
    assert any("no schema" in p for p in schemas.problems(unknown))
    # CRDs carry Go regular expressions; Python accepts inline flags only at the start.
    assert schemas.python_regex("^(?i)(abort|warn)?$") == "(?i)^(abort|warn)?$"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", crossrefs.ALL_CHECKS, ids=lambda c: c.__name__)
def test_cross_references(
    overlays: dict[str, Rendered], overlay: str, check: Callable[[Rendered], list[str]]
) -> None:
    assert check(overlays[overlay]) == []


def test_cross_reference_checks_catch_mismatches(overlays: dict[str, Rendered]) -> None:
    broken = Rendered("broken", copy.deepcopy(overlays["prod-gpu"].objects))
    broken.get("Service", "sluice-router-headless")["spec"]["selector"]["app.kubernetes.io/component"] = "x"
    broken.get("Service", "sluice-router")["spec"]["ports"][0]["targetPort"] = 9999
    broken.get("PodDisruptionBudget", "sluice-worker")["spec"]["selector"] = {"matchLabels": {"a": "b"}}
    broken.get("Deployment", "sluice-worker")["spec"]["replicas"] = 4
    pod_spec(broken.get("Deployment", "sluice-router"))["volumes"][0]["configMap"]["name"] = "gone"
    broken.get("ServiceMonitor", "sluice")["spec"]["endpoints"][0]["port"] = "http-metrics"

    assert any("sluice-router-headless" in p for p in crossrefs.service_routes(broken))
    assert any("9999" in p for p in crossrefs.service_routes(broken))
    assert crossrefs.disruption_budgets(broken)
    assert any("replicas" in p for p in crossrefs.scale_targets(broken))
    assert any("gone" in p for p in crossrefs.object_references(broken))
    assert any("http-metrics" in p for p in crossrefs.monitor_targets(broken))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_sluice_command_line_parses(overlays: dict[str, Rendered], overlay: str) -> None:
    invocations = all_invocations(overlays[overlay])
    assert [f"{i.where}: {i.error}" for i in invocations if i.error] == []
    commands = {i.args.command for i in invocations if i.args is not None}
    assert {"router", "worker", "health"} <= commands
    assert parse(["helth", "127.0.0.1:9000"], "test").error
    assert parse(["health", "127.0.0.1:9000", "--wait", "3"], "test").error


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["router", "worker"])
def test_ports_agree(overlays: dict[str, Rendered], overlay: str, role: str, tmp_path: Path) -> None:
    rendered = overlays[overlay]
    workload, container = _router(rendered) if role == "router" else _worker(rendered)
    config = effective_config(rendered, workload, container, tmp_path)
    section = config.router if role == "router" else config.worker
    grpc_port, metrics_port = _port(container, "grpc"), _port(container, "metrics")
    assert port_of(section.listen) == grpc_port
    assert section.metrics_port == metrics_port
    probes = [(where, inv) for where, inv in container_invocations(workload, container) if where != "main"]
    health = [(where, inv.args) for where, inv in probes if inv.args and inv.args.command == "health"]
    assert {where for where, _ in health} >= {"readinessProbe", "livenessProbe"}
    for where, args in health:
        assert host_of(args.addr) == "127.0.0.1" and port_of(args.addr) == grpc_port, where
        assert args.timeout < container[where]["timeoutSeconds"], f"{where}: the probe would time out first"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_file_agrees_with_flags(overlays: dict[str, Rendered], overlay: str, tmp_path: Path) -> None:
    """Flags win over sluice.yaml; a file that says otherwise would mislead whoever reads it."""
    rendered = overlays[overlay]
    shared = {"router": ("listen", "metrics_port"), "worker": ("listen", "metrics_port", "repository")}
    for role, (workload, container) in (("router", _router(rendered)), ("worker", _worker(rendered))):
        effective = effective_config(rendered, workload, container, tmp_path)
        file_only = effective_config(rendered, workload, container, tmp_path, flags=False)
        for field in shared[role]:
            in_file = getattr(getattr(file_only, role), field)
            assert in_file == getattr(getattr(effective, role), field), f"{role}.{field}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_outlasts_the_drain(overlays: dict[str, Rendered], overlay: str, tmp_path: Path) -> None:
    assert _drain_problems(overlays[overlay], tmp_path) == []


def test_drain_check_catches_a_short_grace_period(overlays: dict[str, Rendered], tmp_path: Path) -> None:
    broken = Rendered("broken", copy.deepcopy(overlays["prod-gpu"].objects))
    pod_spec(broken.get("Deployment", "sluice-worker"))["terminationGracePeriodSeconds"] = 30
    assert any("terminationGracePeriodSeconds" in p for p in _drain_problems(broken, tmp_path))


def _drain_problems(rendered: Rendered, scratch: Path) -> list[str]:
    """The worker drains within its grace period: drain_timeout_s (from the mounted sluice.yaml), and a
    preStop hook's --wait if there is one, end before the kubelet's SIGKILL, and such a hook drains this
    very worker."""
    workload, container = _worker(rendered)
    config = effective_config(rendered, workload, container, scratch)
    grace = pod_spec(workload).get("terminationGracePeriodSeconds", 30)
    drain_s = config.worker.drain_timeout_s
    found = []
    if not grace > drain_s:
        found.append(f"terminationGracePeriodSeconds {grace} <= worker.drain_timeout_s {drain_s}")
    hooks = [i.args for w, i in container_invocations(workload, container) if w == "lifecycle.preStop"]
    drains = [a for a in hooks if a is not None and a.command == "drain"]
    if not drains:
        return found  # SIGTERM drains, within the same bound
    if len(drains) != 1:
        return [*found, f"expected at most one `sluice drain` preStop hook, found {len(drains)}"]
    if drains[0].wait > drain_s:
        found.append(f"preStop --wait {drains[0].wait} > worker.drain_timeout_s {drain_s}")
    worker_id = main_args(workload, container).worker_id
    if _env_name(drains[0].worker_id) != _env_name(worker_id):
        found.append(f"preStop drains {drains[0].worker_id}, the worker registers as {worker_id}")
    return found


def _env_name(reference: str) -> str:
    """`$(POD_NAME)` (Kubernetes) and `$POD_NAME` (sh) both name POD_NAME."""
    return reference.removeprefix("$(").removesuffix(")").removeprefix("$")


def test_liveness_scripts_tolerate_not_serving(overlays: dict[str, Rendered], tmp_path: Path) -> None:
    """Liveness must restart a process that cannot answer (exit 2, 3), never one that answers
    NOT_SERVING (4: no ready worker, or draining). The scripts run under sh with a fake `sluice`."""
    fake = tmp_path / "sluice"
    fake.write_text('#!/bin/sh\nexit "$FAKE_RC"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    rendered = overlays["prod-gpu"]
    scripts = {
        ref(w): c["livenessProbe"]["exec"]["command"]
        for w in rendered.workloads()
        for c in containers(pod_spec(w))
        if is_sluice(c) and "livenessProbe" in c
    }
    assert len(scripts) == 2
    for where, command in scripts.items():
        outcomes = {}
        for rc in range(5):
            env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_RC": str(rc)}
            outcomes[rc] = subprocess.run(command, env=env, check=False, timeout=10).returncode == 0
        assert outcomes == {0: True, 1: False, 2: False, 3: False, 4: True}, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_endpoints_reach_the_statefulset(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    rendered = overlays[overlay]
    etcd = rendered.get("StatefulSet", "sluice-etcd")
    headless = rendered.get("Service", etcd["spec"]["serviceName"])
    members = {f"sluice-etcd-{i}.{headless['metadata']['name']}" for i in range(etcd["spec"]["replicas"])}
    client_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "client")
    for workload, container in (_router(rendered), _worker(rendered)):
        endpoints = effective_config(rendered, workload, container, tmp_path).etcd.endpoints
        assert {host_of(e) for e in endpoints} == members, ref(workload)
        assert {port_of(e) for e in endpoints} == {client_port}, ref(workload)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routers_get_the_tenant_keys(overlays: dict[str, Rendered], overlay: str, tmp_path: Path) -> None:
    rendered = overlays[overlay]
    config = effective_config(rendered, *_router(rendered), tmp_path)
    if overlay == "dev":
        assert len(config.tenants["demo"].api_keys) == 1 and "anonymous" in config.tenants
    else:
        assert config.admission.require_api_key and "anonymous" not in config.tenants
        assert set(config.tenants) == {"default"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routers_and_workers_share_the_cluster_hop(
    overlays: dict[str, Rendered], overlay: str, tmp_path: Path
) -> None:
    """Production: mTLS at both ends and no token. Dev: the token routers present is one workers accept
    (the published one, which only --dev workers take). Both ends agree on the message limit."""
    rendered = overlays[overlay]
    router = effective_config(rendered, *_router(rendered), tmp_path).cluster
    worker_config = effective_config(rendered, *_worker(rendered), tmp_path)
    worker = worker_config.cluster
    assert router.max_message_bytes == worker.max_message_bytes
    if overlay != "dev":
        assert router.tls and worker.tls and router.token_value() is None and worker.accepted() == []
        return
    token = router.token_value()
    assert token == DEV_CLUSTER_TOKEN and token in worker.accepted()
    assert worker_config.worker.dev is True
    refuse_dev_token(worker, dev=worker_config.worker.dev)
    with pytest.raises(ConfigError, match="--dev"):
        refuse_dev_token(worker, dev=False)


def test_dev_has_an_admin_key(overlays: dict[str, Rendered], tmp_path: Path) -> None:
    """Dev has keyed tenants, so admin RPCs need an admin key: the overlay configures one."""
    rendered = overlays["dev"]
    assert len(effective_config(rendered, *_router(rendered), tmp_path).router.admin_keys) == 1


def test_dev_runs_cpu_workers_on_generated_demo_models(overlays: dict[str, Rendered], tmp_path: Path) -> None:
    rendered = overlays["dev"]
    workload, worker = _worker(rendered)
    assert effective_config(rendered, workload, worker, tmp_path).worker.device == "cpu"
    for container in containers(pod_spec(workload)):
        for amounts in container.get("resources", {}).values():
            assert "nvidia.com/gpu" not in amounts
    repository = str(main_args(workload, worker).repository)
    init = [c for c in pod_spec(workload).get("initContainers", []) if is_sluice(c)]
    assert len(init) == 1
    args = main_args(workload, init[0])
    assert (args.command, args.models_command, str(args.repository)) == ("models", "init", repository)
    mounts = {c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]} for c in (init[0], worker)}
    assert mounts[init[0]["name"]][repository]["name"] == mounts["worker"][repository]["name"]
    assert mounts["worker"][repository].get("readOnly") is True


@pytest.mark.parametrize("overlay", PROD)
def test_prod_runs_gpu_workers(overlays: dict[str, Rendered], overlay: str, tmp_path: Path) -> None:
    rendered = overlays[overlay]
    workload, worker = _worker(rendered)
    assert effective_config(rendered, workload, worker, tmp_path).worker.device == "cuda:0"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    spec = pod_spec(workload)
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]) and spec["nodeSelector"]
    models = next(v for v in spec["volumes"] if v["name"] == "models")
    assert rendered.has("PersistentVolumeClaim", models["persistentVolumeClaim"]["claimName"])
    assert rendered.get("Deployment", "sluice-router")["spec"]["replicas"] == 3
    for name in ("sluice-router", "sluice-worker", "sluice-etcd"):
        assert rendered.has("PodDisruptionBudget", name)
    for w in rendered.workloads():
        for c in containers(pod_spec(w)):
            requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
            assert {"cpu", "memory"} <= set(requests) and "memory" in limits, f"{ref(w)} {c['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_namespace_and_one_pinned_image_per_role(overlays: dict[str, Rendered], overlay: str) -> None:
    rendered = overlays[overlay]
    for obj in rendered.objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == NAMESPACE, ref(obj)
    images: dict[bool, set[str]] = {True: set(), False: set()}
    for w in rendered.workloads():
        for c in containers(pod_spec(w)):
            if is_sluice(c):
                images[c["name"] == "router"].add(c["image"])
    # Routers run the slim image (no torch), everything else the worker image: one pinned tag each.
    assert len(images[True]) == 1 and len(images[False]) == 1, images
    (router,), (worker,) = images[True], images[False]
    assert router.endswith("-router") and not worker.endswith("-router")
    for image in (router, worker):
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")


def test_exec_commands_split_shell_scripts() -> None:
    script = 'exec sluice drain "$POD_NAME" --wait 30; rc=$?; [ "$rc" -eq 0 ] || true'
    assert exec_commands(["sh", "-c", script]) == [
        ["sluice", "drain", "$POD_NAME", "--wait", "30"],
        ["rc=$?"],
        ["[", "$rc", "-eq", "0", "]"],
        ["true"],
    ]
    assert exec_commands(["sluice", "health", "127.0.0.1:1"]) == [["sluice", "health", "127.0.0.1:1"]]
    assert list(handler_commands({"lifecycle": {"preStop": {"exec": {"command": ["x"]}}}})) == [
        ("lifecycle.preStop", ["x"])
    ]
