"""Every `sluice …` and `make …` command written in README.md and docs/*.md, checked against the real
CLI and a live local cluster, so that the docs cannot drift from the CLI again.

What counts as a command: a line of a shell code block (sh, bash, shell; console: `$ ` lines) or inline
code that starts with `sluice ` or `make `, after optional `VAR=value` assignments. Not commands: a
message the CLI prints (`sluice bench: error: …`) and plain code blocks (output). Each command is:
- `make TARGET`: the target is one `make help` lists and `make -n TARGET` succeeds; the `sluice up` that
  `make run` runs (RUN_ARGS included) parses;
- inline code naming a command without arguments (`sluice drain` in prose): that command exists;
- otherwise, its PLACEHOLDERS filled in with the live cluster's values (optional `[…]` parts of a synopsis
  left out), parsed by the real parser (no usage error); then
  - long-running ones (LONG_RUNNING) stop there, their --config file loaded;
  - SKIPPED ones stop there, for the reason given (a command added to the docs that cannot run here must
    be listed, with its reason, or this test fails);
  - every other one runs for real, as written plus SHORT_RUN's changes and the live cluster's addresses
    where the command would use its defaults (DEFAULT_ADDR), and must exit as EXPECTED_EXIT says (else 0).

One `sluice up` (three workers) serves the whole module. Commands that need a production-like router
(operations.md's `<router>`, `<admin key>`, and the load generator's scenarios, which send tenant keys)
go to a second router started with `--config bench/scenarios/cluster-tenants.yaml` and an admin key. It
joins after the cluster-wide commands (`sluice cache …` asks every router, and it has admin keys); the
drains come last. Commands run in a scratch folder holding `bench/` (a link), a copy of the demo
`models/` and `docs/figures/`, so outputs stay out of the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_inference.cli.main import _build_parser
from sluice_inference.cli.sim_cmd import run_sim
from sluice_inference.common.config import load_config
from sluice_inference.common.local_cluster import free_port
from sluice_inference.router.policy.tenants import hash_api_key
from tests.e2e.conftest import Cluster, local_cluster
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ADMIN_KEY = "docs-admin-key"

# What the docs' placeholders stand for here, in order ({name}: a live value). Matched as whole words.
PLACEHOLDERS = [
    ("localhost:8001", "{router}"),  # `make run`'s router
    ("127.0.0.1:PORT", "{router}"),  # kubernetes.md: a probe inside the router's pod
    ("ADDR", "{router}"),
    ("<router>:8001", "{deployment}"),  # operations.md: a production router, with tenants and admin keys
    ("<admin key>", ADMIN_KEY),
    ("<etcd>:2379", "{etcd}"),
    ("<token file>", "{token_file}"),  # the cluster token file `sluice up` prints
    ("sluice.yaml", "bench/scenarios/cluster-tenants.yaml"),  # the docs' name for your config: an example
    ("WORKER", "worker-3"),
    ("MODEL[:VERSION]", "mlp"),
    ("MODEL", "mlp"),
    ("M", "mlp"),
    ("NEWKEY", "new-key"),
    ("KEY", "a-key"),
    ("models check DIR", "models check models/"),
    ("/path/to/triton/models", "models/"),  # the demo repository has a Triton model (mlp_onnx)
    ("/models", "models/"),  # kubernetes.md: the init container's volume
    ("DIR", "certs"),  # `sluice certs dev DIR`, `--ca DIR/ca.pem`, `--certs DIR`
    ("sim SCENARIO.yaml", "sim bench/scenarios/sim_steady.yaml"),
    ("sim SCENARIO", "sim bench/scenarios/sim_steady.yaml"),
    ("bench SCENARIO.yaml", "bench bench/scenarios/bursty.yaml"),
    ("N", "2"),
    ("P", "{free_port}"),
    ("...", ""),  # `sluice worker ...`: arguments left out
]

# Run until stopped: parsed (and their --config loaded), not run. `sluice up` itself runs as the fixture.
LONG_RUNNING = {"up", "router", "worker"}

# Not run here, and why (keys: the command as written in the docs).
SKIPPED = {
    "sluice infer --tls --ca DIR/ca.pem --model mlp --random": (
        "needs `sluice up --tls`; tests/e2e/test_tls_cluster.py runs it"
    ),
    "sluice health --tls --ca DIR/ca.pem localhost:8001": (
        "needs `sluice up --tls`; tests/e2e/test_tls_cluster.py runs it"
    ),
    "sluice sim bench/scenarios/sim_scale.yaml": (
        "1,000 simulated workers: 10-25 s whatever the duration; tests/unit/bench/test_sim.py runs it briefly"
    ),
    "sluice models init --gpu --repository DIR": (
        "writes 1.3 GB of BERT-base artifacts; tests/unit/worker/test_demo_transformer.py writes the same "
        "models at a tiny shape, tests/e2e/test_gpu_kit.py serves them"
    ),
    "sluice sim bench/scenarios/sim_scale_bursty.yaml": (
        "1,000 simulated workers: 10-25 s whatever the duration; test_sim.py loads it (every scenario)"
    ),
}

# The doc's own exit code where it is not 0.
EXPECTED_EXIT = {
    # The Commands table's synopsis: the token comes from the config, and this line gives none.
    "sluice drain WORKER": 3,
}

# How a command that would run for minutes (or forever) runs here: flags added at the end (later wins).
SHORT_RUN = {
    "top": ["--once"],  # one frame instead of refreshing until Ctrl-C
    "bench": ["--duration", "1"],  # one second of the scenario's arrivals
    "sim": ["--duration", "0.2"],  # 0.2 s of virtual time per run
}
SWEEP_LOADS = ["--sweep", "0.5"]  # a `sim --sweep`: one load instead of the scenario's range
CEILING_STEPS = ["--step-s", "0.2"]  # `bench --ceiling`: 0.2 s per step instead of 3

# Where a command left to its defaults looks, on the live cluster: etcd through SLUICE_ETCD__ENDPOINTS for
# every command (the default 127.0.0.1:2379); these subcommands get `--addr` (default localhost:8001)...
DEFAULT_ADDR = {"infer", "top", "tenants"}
# ... and `sluice bench` the router with the scenarios' tenants (their `target` is localhost:8001).


@dataclass(frozen=True)
class DocCommand:
    """One command as written, and where."""

    where: str
    text: str
    inline: bool

    @property
    def words(self) -> list[str]:
        """The command's words, its `VAR=value` assignments left out."""
        return re.sub(f"^{_ASSIGNMENTS}", "", self.text).split()


_ASSIGNMENTS = r"(?:[A-Z][A-Z0-9_]*=(?:<[^>]*>|\S+)\s+)*"  # a value may be a placeholder: <token file>
_START = re.compile(rf"^{_ASSIGNMENTS}(?:sluice|make)\s")
_FENCE = re.compile(r"^ *```(.*)$")
_SHELLS = {"sh", "bash", "shell", "console"}


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands written in one markdown file."""
    name = path.relative_to(REPO).as_posix()
    found: list[DocCommand] = []
    prose: list[str] = []
    language: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            language = fence.group(1).strip() if language is None else None
            prose.append("")
            continue
        if language is None:
            prose.append(line)
            continue
        prose.append("")
        text = line.strip()
        if language not in _SHELLS or (language == "console" and not text.startswith("$ ")):
            continue
        text = re.sub(r"\s+#.*$", "", text.removeprefix("$ "))
        if _START.match(text):
            found.append(DocCommand(f"{name}:{number}", " ".join(text.split()), inline=False))
    outside_blocks = "\n".join(prose)
    for code in re.finditer(r"`([^`]+)`", outside_blocks):
        words = " ".join(code.group(1).split())
        if _START.match(words) and not re.match(r"sluice [\w-]+:", words):  # a message, not a command
            number = outside_blocks.count("\n", 0, code.start()) + 1
            found.append(DocCommand(f"{name}:{number}", words, inline=True))
    return found


def _phase(command: DocCommand) -> int:
    """0: the local cluster alone; 1: with the production-like router; 2: drains, which take workers out
    (the ones expected to be refused first, while their worker is still there)."""
    words = command.words
    if words[:2] == ["sluice", "drain"]:
        return 2 if EXPECTED_EXIT.get(command.text, 0) else 3
    needs_deployment = "<router>" in command.text or "<admin key>" in command.text
    return 1 if needs_deployment or (words[:2] == ["sluice", "bench"] and "--ceiling" not in words) else 0


COMMANDS = sorted((c for path in DOCS for c in doc_commands(path)), key=_phase)


def test_the_docs_hold_commands() -> None:
    """The extraction itself: a sanity floor, and every listed exception still in the docs."""
    texts = {c.text for c in COMMANDS}
    assert len(COMMANDS) > 100
    assert "sluice infer --model mlp --random" in texts and "make run" in texts
    assert set(SKIPPED) <= texts, set(SKIPPED) - texts
    assert set(EXPECTED_EXIT) <= texts, set(EXPECTED_EXIT) - texts


@dataclass
class Live:
    """The live cluster the commands run against, a scratch working folder, and what ran already."""

    cluster: Cluster
    workdir: Path
    deployment: str | None = None
    _deployment_process: subprocess.Popen[bytes] | None = None
    ran: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = field(default_factory=dict)

    def value(self, name: str) -> str:
        """A placeholder's live value."""
        if name == "router":
            return self.cluster.addr
        if name == "etcd":
            return f"127.0.0.1:{self.cluster.etcd_port}"
        if name == "token_file":
            return self.cluster.token_env()["SLUICE_CLUSTER__TOKEN_FILE"]
        if name == "free_port":
            return str(free_port())
        assert name == "deployment", name
        return self.start_deployment()

    def start_deployment(self) -> str:
        """A router with the scenarios' tenants and an admin key, joined to the cluster (once)."""
        if self.deployment is None:
            self.deployment = f"127.0.0.1:{free_port()}"
            config = REPO / "bench" / "scenarios" / "cluster-tenants.yaml"
            argv = [
                sys.executable, "-m", "sluice_inference.cli", "router", "--config", str(config), "--listen",
                self.deployment, "--metrics-port", "0", "--etcd", self.value("etcd"), "--router-id",
                "docs-deployment",
            ]  # fmt: skip
            env = {**os.environ, **self.cluster.token_env()}
            env["SLUICE_ROUTER__ADMIN_KEYS"] = json.dumps([hash_api_key(ADMIN_KEY)])
            log = (self.workdir / "deployment-router.log").open("wb")
            self._deployment_process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_until(lambda: _serving(self.deployment or ""), 60, "the production-like router")
        return self.deployment

    def stop(self) -> None:
        """Stop the production-like router, if it started."""
        if self._deployment_process is not None:
            self._deployment_process.send_signal(signal.SIGTERM)
            assert self._deployment_process.wait(30) == 0


def _serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # types-grpcio-health-checking omits Check
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="module")
def live(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """`sluice up --workers 3` on the demo models, and a scratch folder laid out like the repository."""
    workdir = tmp_path_factory.mktemp("docs-workdir")
    (workdir / "bench").symlink_to(REPO / "bench")
    shutil.copytree(demo_repo, workdir / "models")
    (workdir / "docs" / "figures").mkdir(parents=True)
    with local_cluster(demo_repo, tmp_path_factory.mktemp("docs-cluster"), "--workers", "3") as cluster:
        running = Live(cluster, workdir)
        try:
            yield running
        finally:
            running.stop()


def fill(command: DocCommand, live: Live) -> str:
    """The command with its placeholders replaced by live values and its optional `[…]` parts left out."""
    text = re.sub(r"(?<=\s)\[[^\]]*\]", "", command.text)
    for placeholder, replacement in PLACEHOLDERS:
        pattern = rf"(?<![\w/]){re.escape(placeholder)}(?![\w])"
        if re.search(pattern, text):
            value = re.sub(r"\{(\w+)\}", lambda m: live.value(m.group(1)), replacement)
            text = re.sub(pattern, value.replace("\\", "\\\\"), text)
    return " ".join(text.split())


def split(text: str) -> tuple[dict[str, str], list[str]]:
    """Environment assignments and the command's words."""
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def parse(argv: list[str]) -> argparse.Namespace | None:
    """The real parser (None: it printed the help asked for); a usage error fails the test."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return _build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:
            return None
        pytest.fail(f"usage error (exit {exc.code}): sluice {shlex.join(argv)}\n{errors.getvalue()}")


def command_path(argv: list[str]) -> list[str]:
    """The leading words of `argv` that name (sub)commands."""
    parser: argparse.ArgumentParser = _build_parser()
    path = []
    for word in argv:
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
        if word not in choices:
            break
        path.append(word)
        parser = choices[word]
    return path


def test_bench_suggests_commands_that_parse(live: Live) -> None:
    """Against a cluster without the scenario's tenants, `sluice bench` says how to start one: with
    `sluice up --config F` or `make run RUN_ARGS='--config F'`, both of which must then work."""
    refused = run(live, ["bench", "bench/scenarios/steady.yaml", "--target", live.cluster.addr], {})
    assert refused.returncode == 3, refused.stderr
    up = re.search(r"(sluice up --config \S+)", refused.stderr)
    make = re.search(r"(make run RUN_ARGS='--config \S+')", refused.stderr)
    assert up and make, refused.stderr
    args = parse(shlex.split(up.group(1))[1:])
    assert args is not None
    load_config(live.workdir / args.config)
    check_make(shlex.split(make.group(1))[1:])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where} {c.text}")
def test_doc_command(command: DocCommand, live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    if command.words[0] == "make":
        check_make(command.words[1:])
        return
    argv = command.words[1:]
    if command.inline and argv and command_path(argv) == argv:  # a reference to a command in prose
        with pytest.raises(SystemExit) as shown, contextlib.redirect_stdout(io.StringIO()):
            _build_parser().parse_args([*argv, "--help"])
        assert shown.value.code == 0
        return
    env, words = split(fill(command, live))
    args = parse(words[1:])
    if command.text in SKIPPED:
        pytest.skip(SKIPPED[command.text])
    if args is None:  # `--help`: printed, exit 0
        return
    if args.command in LONG_RUNNING:
        if args.config is not None:
            load_config(live.workdir / args.config)
        return
    argv = [*words[1:], *short_run(args, live)]
    if args.command == "sim":  # no cluster: in this process, saving an interpreter start per scenario
        monkeypatch.chdir(live.workdir)
        sim_args = parse(argv)
        assert sim_args is not None
        code = run_sim(sim_args)
        output = ""
    else:
        done = run(live, argv, env)
        code, output = done.returncode, done.stdout + done.stderr
    assert code == EXPECTED_EXIT.get(command.text, 0), f"sluice {shlex.join(argv)}\n{output}"


def short_run(args: argparse.Namespace, live: Live) -> list[str]:
    """Flags added so that the command runs briefly against the live cluster (SHORT_RUN, DEFAULTS)."""
    if args.command == "bench" and args.ceiling:
        return CEILING_STEPS
    extra = list(SHORT_RUN.get(args.command, []))
    if args.command in DEFAULT_ADDR and args.addr == "localhost:8001":  # left to its default
        extra += ["--addr", live.cluster.addr]
    if args.command == "bench":
        extra += ["--target", live.start_deployment()]
    if args.command == "sim" and args.sweep is not None:
        extra += SWEEP_LOADS
    return extra


def run(live: Live, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`sluice ARGV` in the scratch folder, etcd's default pointing at the live one; the same command
    written twice runs once."""
    key = (*argv, *(f"{k}={v}" for k, v in sorted(env.items())))
    if key not in live.ran:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        environ["SLUICE_ETCD__ENDPOINTS"] = json.dumps([live.value("etcd")])
        live.ran[key] = subprocess.run(
            [sys.executable, "-m", "sluice_inference.cli", *argv],
            cwd=live.workdir,
            env={**environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    return live.ran[key]


def check_make(words: list[str]) -> None:
    """A documented `make` target exists (listed by `make help`, `make -n` succeeds); `make run`'s
    `sluice up` line, with the RUN_ARGS given, parses."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    target = words[0]
    listed = subprocess.run(
        ["make", "-C", str(REPO), "--no-print-directory", "help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert f"make {target} " in listed.stdout, listed.stdout
    dry = subprocess.run(
        ["make", "-C", str(REPO), "--no-print-directory", "-n", *words],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    if target == "run":
        [line] = [line for line in dry.stdout.splitlines() if re.search(r"sluice up\b", line)]
        up = shlex.split(line)
        parse(up[next(i for i, w in enumerate(up) if w.endswith("sluice")) + 1 :])
