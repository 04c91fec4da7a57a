"""Cross-reference checks over one rendered overlay: every name, selector and port that points at another
object must find it.

Why: a schema validates each object alone, and the API server accepts a Service whose selector matches no
pod or a PodDisruptionBudget that protects nothing; such mistakes only show as an outage. Each check
returns the problems it found (empty: none), so a test can assert `== []` and print every problem at once,
and a negative test can show that a broken object is caught.
"""

from __future__ import annotations

from collections.abc import Iterator

from tests.deploy.rendering import (
    Obj,
    Rendered,
    containers,
    pod_labels,
    pod_spec,
    ref,
    selector_matches,
    service_selects,
)


def workload_selectors(rendered: Rendered) -> list[str]:
    """Each workload's selector matches its own pod template."""
    return [
        f"{ref(w)}: selector does not match its pod template labels {pod_labels(w)}"
        for w in rendered.workloads()
        if not selector_matches(w["spec"]["selector"], pod_labels(w))
    ]


def service_routes(rendered: Rendered) -> list[str]:
    """Each Service selects some workload's pods, and each of its targetPorts is a port those pods open."""
    found: list[str] = []
    for service in rendered.of_kind("Service"):
        matched = [w for w in rendered.workloads() if service_selects(service, pod_labels(w))]
        if not matched:
            found.append(f"{ref(service)}: selector {service['spec'].get('selector')} matches no pods")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found += [
                f"{ref(service)}: targetPort {target!r} is not a containerPort of {ref(w)}"
                for w in matched
                if not any(_opens(c, target) for c in containers(pod_spec(w), init=False))
            ]
    return found


def _opens(container: Obj, target: int | str) -> bool:
    return any(target in (port["containerPort"], port.get("name")) for port in container.get("ports", []))


def disruption_budgets(rendered: Rendered) -> list[str]:
    """Each PodDisruptionBudget protects exactly one workload's pods."""
    found = []
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        matched = [
            w for w in rendered.workloads() if selector_matches(pdb["spec"]["selector"], pod_labels(w))
        ]
        if len(matched) != 1:
            found.append(f"{ref(pdb)}: selects {len(matched)} workloads ({[ref(w) for w in matched]})")
    return found


def object_references(rendered: Rendered) -> list[str]:
    """ConfigMaps, Secrets, PVCs and volumes that pods name exist (after kustomize's name hashing)."""
    found = []
    for workload in rendered.workloads():
        spec = pod_spec(workload)
        for problem in _volume_problems(rendered, workload) + _env_problems(rendered, spec):
            found.append(f"{ref(workload)}: {problem}")
    return found


def _volume_problems(rendered: Rendered, workload: Obj) -> list[str]:
    spec = pod_spec(workload)
    found = []
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            found += _config_map_items(rendered, volume["configMap"])
        if "secret" in volume and not _secret_exists(rendered, volume["secret"]["secretName"]):
            found.append(f"volume {volume['name']}: no Secret {volume['secret']['secretName']}")
        found += _csi_problems(rendered, volume)
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim and not rendered.has("PersistentVolumeClaim", claim):
            found.append(f"volume {volume['name']}: no PersistentVolumeClaim {claim}")
    declared = {v["name"] for v in spec.get("volumes", [])}
    declared |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    for container in containers(spec):
        found += [
            f"container {container['name']} mounts undeclared volume {m['name']}"
            for m in container.get("volumeMounts", [])
            if m["name"] not in declared
        ]
    return found


def certificate_secrets(rendered: Rendered) -> set[str]:
    """Secrets that cert-manager will create: every Certificate's `secretName`."""
    return {c["spec"]["secretName"] for c in rendered.of_kind("Certificate")}


def _secret_exists(rendered: Rendered, name: str) -> bool:
    """A Secret rendered, or one a rendered Certificate makes."""
    return rendered.has("Secret", name) or name in certificate_secrets(rendered)


def _csi_problems(rendered: Rendered, volume: Obj) -> list[str]:
    """A cert-manager csi-driver volume names an Issuer that is rendered (when any Issuer is: an overlay
    without cert-manager objects expects them from elsewhere)."""
    attributes = volume.get("csi", {}).get("volumeAttributes", {})
    issuer = attributes.get("csi.cert-manager.io/issuer-name")
    if issuer is None or not rendered.of_kind("Issuer") or rendered.has("Issuer", issuer):
        return []
    return [f"volume {volume['name']}: no Issuer {issuer}"]


def _config_map_items(rendered: Rendered, source: Obj) -> list[str]:
    if not rendered.has("ConfigMap", source["name"]):
        return [f"no ConfigMap {source['name']}"]
    data = rendered.get("ConfigMap", source["name"]).get("data", {})
    return [
        f"ConfigMap {source['name']} has no key {i['key']}"
        for i in source.get("items", [])
        if i["key"] not in data
    ]


def _env_problems(rendered: Rendered, spec: Obj) -> list[str]:
    found = []
    for container in containers(spec):
        for source in container.get("envFrom", []):
            for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                if key in source and not rendered.has(kind, source[key]["name"]):
                    found.append(
                        f"container {container['name']}: envFrom names no {kind} {source[key]['name']}"
                    )
        for var in container.get("env", []):
            found += _env_value_problems(rendered, container["name"], var)
    return found


def _env_value_problems(rendered: Rendered, container: str, var: Obj) -> list[str]:
    source = var.get("valueFrom", {})
    for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
        if key not in source:
            continue
        name, item = source[key]["name"], source[key]["key"]
        if not rendered.has(kind, name):
            return [f"container {container}: env {var['name']} names no {kind} {name}"]
        obj = rendered.get(kind, name)
        if item not in {**obj.get("data", {}), **obj.get("stringData", {})}:
            return [f"container {container}: env {var['name']}: {kind} {name} has no key {item}"]
    return []


def scale_targets(rendered: Rendered) -> list[str]:
    """HPAs and ScaledObjects target an existing Deployment, one scaler each, which sets no `replicas`
    (a re-apply would otherwise reset what the autoscaler chose)."""
    found = []
    seen: dict[str, str] = {}
    for scaler in _scalers(rendered):
        target = scaler["spec"]["scaleTargetRef"]
        kind, name = target.get("kind", "Deployment"), target["name"]
        if not rendered.has(kind, name):
            found.append(f"{ref(scaler)}: no {kind} {name} to scale")
            continue
        if "replicas" in rendered.get(kind, name)["spec"]:
            found.append(f"{ref(scaler)}: {kind}/{name} sets spec.replicas, which fights the autoscaler")
        if name in seen:
            found.append(f"{ref(scaler)}: {kind}/{name} is already scaled by {seen[name]}")
        seen[name] = ref(scaler)
    return found


def _scalers(rendered: Rendered) -> Iterator[Obj]:
    yield from rendered.of_kind("HorizontalPodAutoscaler")
    yield from rendered.of_kind("ScaledObject")


def monitor_targets(rendered: Rendered) -> list[str]:
    """Each ServiceMonitor selects some Service, and every Service it selects has each scraped port."""
    found = []
    for monitor in rendered.of_kind("ServiceMonitor"):
        matched = [
            s
            for s in rendered.of_kind("Service")
            if selector_matches(monitor["spec"]["selector"], s["metadata"].get("labels", {}))
        ]
        if not matched:
            found.append(f"{ref(monitor)}: selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            found += [
                f"{ref(monitor)}: {ref(s)} has no port named {endpoint['port']}"
                for s in matched
                if endpoint["port"] not in {p.get("name") for p in s["spec"]["ports"]}
            ]
    return found


def network_policies(rendered: Rendered) -> list[str]:
    """Each NetworkPolicy selects some workload's pods, each `from` pod selector selects some workload, and
    each named port it opens is a port of the pods it protects."""
    found = []
    for policy in rendered.of_kind("NetworkPolicy"):
        spec = policy["spec"]
        targets = [w for w in rendered.workloads() if selector_matches(spec["podSelector"], pod_labels(w))]
        if not targets:
            found.append(f"{ref(policy)}: podSelector matches no pods")
        for rule in spec.get("ingress", []):
            for peer in rule.get("from", []):
                selector = peer.get("podSelector")
                if selector is not None and not any(
                    selector_matches(selector, pod_labels(w)) for w in rendered.workloads()
                ):
                    found.append(f"{ref(policy)}: from {selector} matches no pods")
            for port in rule.get("ports", []):
                found += [
                    f"{ref(policy)}: port {port['port']!r} is not a port of {ref(w)}"
                    for w in targets
                    if not any(_opens(c, port["port"]) for c in containers(pod_spec(w), init=False))
                ]
    return found


ALL_CHECKS = (
    workload_selectors,
    service_routes,
    disruption_budgets,
    object_references,
    scale_targets,
    monitor_targets,
    network_policies,
)
