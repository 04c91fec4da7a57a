"""The `sluice` command line (cli/parsing.py, cli/main.py): the global flags work before and after the
subcommand, at every level, the one after winning; every command's help opens with what it does and
where its settings come from."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice_inference.cli.main import _build_parser

# Every command that runs something, with the arguments it requires.
REQUIRED = {
    "up": [], "router": [], "worker": [], "health": ["localhost:1"], "infer": ["--model", "m"],
    "workers": [], "drain": ["w"], "keys hash": ["k"], "certs dev": ["d"], "models init": [],
    "models check": ["d"], "bench": ["s.yaml"], "sim": ["s.yaml"], "top": [], "tenants": [],
    "cache purge": ["m"], "cache stats": [],
}  # fmt: skip
LEAVES = [[*name.split(), *args] for name, args in REQUIRED.items()]


def parse(argv: list[str]) -> argparse.Namespace:
    return _build_parser().parse_args(argv)


@pytest.mark.parametrize("leaf", LEAVES, ids=" ".join)
def test_global_flags_go_before_or_after_the_subcommand(leaf: list[str]) -> None:
    before = parse(["--config", "a.yaml", "--log-level", "DEBUG", "--log-format", "text", *leaf])
    after = parse([*leaf, "--config", "a.yaml", "--log-level", "DEBUG", "--log-format", "text"])
    for args in (before, after):
        assert (args.config, args.log_level, args.log_format) == (Path("a.yaml"), "DEBUG", "text")
    defaults = parse(leaf)
    assert (defaults.config, defaults.log_level, defaults.log_format) == (None, "INFO", "json")


@pytest.mark.parametrize("leaf", LEAVES, ids=" ".join)
def test_given_in_both_places_the_one_after_the_subcommand_wins(leaf: list[str]) -> None:
    args = parse(["--config", "before.yaml", "--log-level", "ERROR", *leaf, "--config", "after.yaml"])
    assert args.config == Path("after.yaml")
    assert args.log_level == "ERROR"  # given only before: it stands


def test_between_a_group_and_its_command_the_flag_is_accepted_too() -> None:
    assert parse(["models", "--config", "m.yaml", "init"]).config == Path("m.yaml")
    assert parse(["cache", "--log-level", "DEBUG", "stats"]).log_level == "DEBUG"
    assert parse(["--config", "a", "models", "--config", "b", "init", "--config", "c"]).config == Path("c")


def test_the_readme_up_command_parses() -> None:
    """It used to be a usage error: `--config` was only accepted before the subcommand."""
    args = parse(["up", "--config", "bench/scenarios/cluster-tenants.yaml", "--workers", "3"])
    assert args.command == "up" and args.config == Path("bench/scenarios/cluster-tenants.yaml")


def test_bad_arguments_exit_1() -> None:
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()):
        parse(["up", "--config"])
    assert exited.value.code == 1


def _command_paths(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[list[str]]:
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _command_paths(child, [*path, name])


COMMANDS = list(_command_paths(_build_parser(), []))


def test_every_command_is_covered() -> None:
    groups = {tuple(p[:-1]) for p in COMMANDS if p}
    assert {" ".join(p) for p in COMMANDS if p and tuple(p) not in groups} == set(REQUIRED)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "sluice")
def test_help_opens_with_what_the_command_does_and_where_settings_come_from(path: list[str]) -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stdout(out):
        parse([*path, "--help"])
    assert exited.value.code == 0
    first, second = out.getvalue().splitlines()[:2]
    assert first and not first.startswith("usage:")
    assert first.endswith(".") and len(first) <= 78, f"not one line at 80 columns: {first!r}"
    assert second.startswith("Settings:"), second


def test_router_help_from_the_console_script() -> None:
    """The same through a real process, as `sluice router --help` in a terminal."""
    shown = subprocess.run(
        [sys.executable, "-m", "sluice_inference.cli", "router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Run a router")
    assert "--config sluice.yaml, then SLUICE_* environment variables" in shown.stdout
