"""The `sluice` command lines in rendered pods, read with the real CLI parser, and the config they load.

Why the real parser: a probe, hook or container that calls a subcommand or flag the CLI lacks fails only on
a live cluster (a pod that never turns ready, a drain that never runs). Parsing each one with
`sluice_inference.cli.main`'s own parser catches that here, and gives the tests the parsed values
(ports, timeouts, worker id) instead of a second reading of the flags. `_build_parser` and `_overrides` are
private to cli/; using them keeps one definition of the CLI's rules.

The effective config of a container is what `sluice --config FILE ...` would load there: the mounted
ConfigMap key, then the container's SLUICE_* environment (literal values and envFrom Secrets/ConfigMaps),
then its flags.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sluice_inference.cli.main import _build_parser, _overrides
from sluice_inference.common.config import SluiceConfig, load_config
from tests.deploy.rendering import Obj, Rendered, containers, image_repository, pod_spec, ref

SLUICE_IMAGE = "sluice"
HANDLERS = ("startupProbe", "readinessProbe", "livenessProbe")
SHELL_OPERATORS = frozenset({";", "&&", "||", "|", "&"})


@dataclass(frozen=True)
class Invocation:
    """One `sluice ...` command line found in a pod, parsed (or the parser's complaint)."""

    where: str
    argv: tuple[str, ...]
    args: argparse.Namespace | None
    error: str


def parse(argv: list[str], where: str) -> Invocation:
    """Parse `sluice ARGV` as the CLI would; an invalid line records the CLI's own message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = _build_parser().parse_args(argv)
    except SystemExit:
        return Invocation(where, tuple(argv), None, stderr.getvalue().strip() or "rejected")
    return Invocation(where, tuple(argv), args, "")


def is_sluice(container: Obj) -> bool:
    """Whether the container runs the Sluice image (whose entrypoint is `sluice`)."""
    return image_repository(container["image"]) == SLUICE_IMAGE


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a `sh -c` script (split at ; && || | &), words unquoted as sh would."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def exec_commands(command: list[str]) -> list[list[str]]:
    """The command lines an exec handler runs: itself, or each simple command of its `sh -c` script."""
    if len(command) >= 3 and command[0] in ("sh", "/bin/sh") and command[1] == "-c":
        lines = shell_commands(command[2])
    else:
        lines = [command]
    return [line[1:] if line[0] == "exec" else line for line in lines]


def handler_commands(container: Obj) -> Iterator[tuple[str, list[str]]]:
    """(name, exec command) of each probe and lifecycle hook that runs a command."""
    for name in HANDLERS:
        command = container.get(name, {}).get("exec", {}).get("command")
        if command:
            yield name, command
    for hook, handler in container.get("lifecycle", {}).items():
        command = handler.get("exec", {}).get("command")
        if command:
            yield f"lifecycle.{hook}", command


def container_invocations(workload: Obj, container: Obj) -> list[tuple[str, Invocation]]:
    """Every `sluice` invocation of a container, keyed by where it runs: `main` (the container itself),
    a probe name, or `lifecycle.preStop`."""
    where = f"{ref(workload)} container {container['name']}"
    found = []
    if is_sluice(container) and "command" not in container:
        found.append(("main", parse(list(container.get("args", [])), f"{where} args")))
    for name, command in handler_commands(container):
        for line in exec_commands(command):
            if line and line[0] == "sluice":
                found.append((name, parse(line[1:], f"{where} {name}")))
    return found


def all_invocations(rendered: Rendered) -> list[Invocation]:
    """Every `sluice` invocation in every pod of the overlay."""
    return [
        invocation
        for workload in rendered.workloads()
        for container in containers(pod_spec(workload))
        for _, invocation in container_invocations(workload, container)
    ]


def main_args(workload: Obj, container: Obj) -> argparse.Namespace:
    """The parsed arguments of a Sluice container's own command line; fails loudly if it does not parse."""
    for where, invocation in container_invocations(workload, container):
        if where == "main":
            if invocation.args is None:
                raise AssertionError(f"{invocation.where}: {invocation.error}")
            return invocation.args
    raise AssertionError(f"{ref(workload)} container {container['name']} does not run sluice")


def mounted_file(rendered: Rendered, workload: Obj, container: Obj, path: str) -> str:
    """The text a container reads at `path`, when that path is a ConfigMap key mounted as a volume."""
    wanted = PurePosixPath(path)
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        directory = PurePosixPath(mount["mountPath"])
        source = volumes.get(mount["name"], {}).get("configMap")
        if source is None or wanted.parent != directory:
            continue
        items = {i["path"]: i["key"] for i in source.get("items", [])}
        key = items.get(wanted.name, wanted.name if "items" not in source else None)
        data: dict[str, str] = rendered.get("ConfigMap", source["name"]).get("data", {})
        if key in data:
            return data[key]
    raise AssertionError(f"{ref(workload)} container {container['name']}: nothing mounted at {path}")


def container_env(rendered: Rendered, container: Obj) -> dict[str, str]:
    """The container's environment that a manifest fixes: envFrom sources, then literal `env` values."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            secret = rendered.get("Secret", source["secretRef"]["name"])
            env.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
            env.update(secret.get("stringData", {}))
        if "configMapRef" in source:
            env.update(rendered.get("ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    env.update({v["name"]: v["value"] for v in container.get("env", []) if "value" in v})
    return env


def effective_config(
    rendered: Rendered, workload: Obj, container: Obj, scratch: Path, *, flags: bool = True
) -> SluiceConfig:
    """The config `sluice` would load in this container: mounted file, then SLUICE_* env, then (unless
    `flags` is false) its command-line flags."""
    args = main_args(workload, container)
    path = None
    if args.config is not None:
        path = scratch / f"{rendered.overlay}-{workload['metadata']['name']}-{container['name']}.yaml"
        path.write_text(mounted_file(rendered, workload, container, str(args.config)))
    overrides = _overrides(args) if flags else None
    return load_config(path, overrides=overrides, environ=container_env(rendered, container))


def port_of(address: str) -> int:
    """`0.0.0.0:8001` -> 8001."""
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    """`127.0.0.1:8001` -> `127.0.0.1`."""
    return address.rsplit(":", 1)[0]
