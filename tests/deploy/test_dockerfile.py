"""deploy/docker/Dockerfile builds what the manifests run: a worker image with every package and the pinned
torch, a router image without torch, both as the user and on the ports the pods expect.

Why: no Docker engine runs here, so `docker build` cannot be tried. What can go wrong without one being
noticed is a drift between the Dockerfile and the rest of the repository (a new package not copied, a
torch pin that disagrees with constraints.txt, a uid the pods' runAsUser does not match, a port the
manifests use and the image does not document); these tests read the files and compare.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from tests.deploy.rendering import DEPLOY, OVERLAYS, REPO, Rendered, containers, pod_spec
from tests.deploy.sluice_cli import is_sluice

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"


def _instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    logical = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = (line.strip() for line in logical.splitlines())
    return [
        (keyword.upper(), rest.strip())
        for keyword, _, rest in (line.partition(" ") for line in lines if line and not line.startswith("#"))
    ]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per stage name (`FROM ... AS name`), in order."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for keyword, rest in _instructions():
        if keyword == "FROM":
            stages[rest.split()[-1]] = []
        if stages:
            stages[next(reversed(stages))].append((keyword, rest))
    return stages


def _effective(name: str) -> list[tuple[str, str]]:
    """A stage's instructions after those of the stages it is built FROM (what the image inherits)."""
    stages = _stages()
    base = stages[name][0][1].split()[0]
    return (_effective(base) if base in stages else []) + stages[name]


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_multi_stage_build_runs_sluice_as_a_non_root_user() -> None:
    stages = _stages()
    assert list(stages)[-1] == "worker", "the default target (last stage) is the worker image"
    bases = {rest.split()[0] for stage in stages.values() for keyword, rest in stage if keyword == "FROM"}
    assert bases - set(stages) == {"${PYTHON_IMAGE}"}, "the venv copied between stages needs the same Python"
    scripts = _pyproject()["project"]
    assert isinstance(scripts, dict) and "sluice" in scripts["scripts"]
    for image, venv_from in (("worker", "build-worker"), ("router", "build")):
        final = dict(_effective(image))
        user, _, group = final["USER"].partition(":")
        assert user.isdigit() and int(user) > 0 and group.isdigit()
        assert json.loads(final["ENTRYPOINT"]) == ["sluice"]
        assert ("COPY", f"--from={venv_from} /opt/sluice /opt/sluice") in stages[image]


def _args(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for keyword, rest in stage if keyword == "ARG" and "=" in rest)


def test_torch_comes_from_a_chosen_index_at_the_pinned_version() -> None:
    worker = _stages()["build-worker"]
    args = _args(worker)
    assert "TORCH_INDEX_URL" in args
    pin = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert pin and args["TORCH_VERSION"] == pin.group(1)
    runs = [rest for keyword, rest in worker if keyword == "RUN"]
    assert any('--index-url "${TORCH_INDEX_URL}"' in r and "torch==${TORCH_VERSION}" in r for r in runs)
    assert any('-c constraints.txt ".[worker,onnx]"' in r for r in runs)


def test_the_router_image_is_the_slim_install_without_torch() -> None:
    build = _stages()["build"]
    runs = [rest for keyword, rest in build if keyword == "RUN"]
    assert any("pip install -c constraints.txt . " in r for r in runs), "no extras: no torch"
    assert not any("torch" in rest.lower() for _, rest in build)
    extras = _pyproject()["project"]
    assert isinstance(extras, dict)
    assert not any(d.startswith("torch") for d in extras["dependencies"]), "torch is the worker extra's"


def _copied() -> set[str]:
    sources: set[str] = set()
    for keyword, rest in _instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            sources.update(part.rstrip("/") for part in rest.split()[:-1])
    return sources


def test_every_package_is_copied_and_none_is_ignored() -> None:
    tool = _pyproject()["tool"]
    assert isinstance(tool, dict)
    packages = {p.rstrip("*") for p in tool["setuptools"]["packages"]["find"]["include"]}
    copied = _copied()
    needed = packages | {"pyproject.toml", "constraints.txt", "README.md"}
    assert needed <= copied
    for source in copied:
        assert (REPO / source).exists(), source
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in copied:
        assert not [p for p in patterns if fnmatch.fnmatch(source, p)], source
    assert {".venv", ".git", "models"} <= set(patterns)


def test_image_matches_what_the_pods_expect(overlays: dict[str, Rendered]) -> None:
    for image in ("router", "worker"):
        final = _effective(image)
        exposed = {int(p) for keyword, rest in final if keyword == "EXPOSE" for p in rest.split()}
        uid = int(dict(final)["USER"].partition(":")[0])
        for overlay in OVERLAYS:
            for workload in overlays[overlay].workloads():
                spec = pod_spec(workload)
                for container in containers(spec):
                    if not is_sluice(container):
                        continue
                    ports = {p["containerPort"] for p in container.get("ports", [])}
                    assert ports <= exposed, f"{overlay} {container['name']}: {ports - exposed} not EXPOSEd"
                    assert spec["securityContext"]["runAsUser"] == uid
