"""The `sluice` argument parsers: exit codes, the global flags, and what every `--help` opens with.

Rules:
- Bad arguments exit 1, as grpc_health_probe does (argparse's own 2 means "cannot connect" here).
- The global flags (`--config`, `--log-level`, `--log-format`) are accepted before the subcommand and
  after it, at any level (`sluice --config F models init` = `sluice models init --config F`), as kubectl
  does. Given in both places, the one after the subcommand wins: argparse's rule that a later flag
  overrides an earlier one, which `sluice router --processes` already relies on for its children.
- Every parser's help starts with one line saying what the command does, then one saying where its
  settings come from, and only then the usage line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

EXIT_BAD_ARGS = 1

FROM_CONFIG = "Settings: --config sluice.yaml, then SLUICE_* environment variables ({example}), then flags."
FROM_FLAGS = "Settings: flags only (--config and SLUICE_* variables are not read)."
FROM_FLAGS_AND_KEY = "Settings: flags; the API key from --api-key, else $SLUICE_API_KEY."
ADMIN_KEY = (
    "Settings: flags; an admin API key from --api-key, else $SLUICE_API_KEY (none needed in key-less "
    "local mode)."
)


def about(what: str, settings: str, more: str = "") -> str:
    """A parser's description: what it does (one line), where its settings come from, then details."""
    return "\n".join(part for part in (what, settings, more) if part)


class Parser(argparse.ArgumentParser):
    """argparse, but bad arguments exit 1, and the help opens with the description, before the usage."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_ARGS, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        description = self.description
        if not description:
            return super().format_help()
        width = min(shutil.get_terminal_size().columns - 2, 110)
        header = "\n".join(textwrap.fill(line, width) for line in description.splitlines())
        self.description = None  # printed above instead of below the usage line
        try:
            return f"{header}\n\n{super().format_help()}"
        finally:
            self.description = description


class SubcommandParser(Parser):
    """A subcommand's parser: it also takes the global flags, without a default so that one given
    before the subcommand stands unless it is given again after it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_global_flags(self, with_defaults=False)


def add_global_flags(parser: argparse.ArgumentParser, *, with_defaults: bool) -> None:
    """--config, --log-level, --log-format: with their defaults on the top-level parser only."""

    def default(value: object) -> object:
        return value if with_defaults else argparse.SUPPRESS

    group = parser.add_argument_group(
        "global options",
        "before or after the subcommand"
        if with_defaults
        else "also before the subcommand; if both, this one wins",
    )
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=default(None),
        help="sluice.yaml (SLUICE_* environment variables override it, flags override both)",
    )
    group.add_argument(
        "--log-level", default=default("INFO"), help="DEBUG, INFO, WARNING or ERROR (default INFO)"
    )
    group.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=default("json"),
        help="json lines (default) or plain text",
    )


def add_etcd_flags(parser: argparse.ArgumentParser) -> None:
    """--etcd and --prefix, on a command that reads or writes the cluster registry."""
    parser.add_argument(
        "--etcd", metavar="HOST:PORT", help="etcd endpoint (default: config, else 127.0.0.1:2379)"
    )
    parser.add_argument("--prefix", help="etcd key prefix (default: /sluice/)")


def subcommands(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction[SubcommandParser]:
    """The subcommand slot of `parser` (required), whose parsers take the global flags too."""
    return parser.add_subparsers(dest=dest, required=True, parser_class=SubcommandParser)


def add_command(
    sub: argparse._SubParsersAction[Any], name: str, what: str, settings: str, more: str = ""
) -> argparse.ArgumentParser:
    """A subcommand whose `sluice --help` line is `what` and whose own help opens with `what` and
    `settings` (then `more`)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=what, description=about(what, settings, more))
    return parser
