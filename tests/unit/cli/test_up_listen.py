"""`sluice up` keeps its router on this machine unless told otherwise: the default config serves key-less
callers as an unlimited tenant with open admin, which is only safe where nobody else can connect."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sluice_inference.cli.cluster import banner, join_commands
from sluice_inference.cli.main import _build_parser
from sluice_inference.common.local_cluster import ClusterEnv, reachable_host, router_listen


def up(*flags: str) -> argparse.Namespace:
    return _build_parser().parse_args(["up", *flags])


def test_the_router_binds_loopback_by_default() -> None:
    assert router_listen(up()) == "127.0.0.1:8001"
    assert router_listen(up("--port", "9001")) == "127.0.0.1:9001"


@pytest.mark.parametrize(
    ("host", "listen", "reached_at"),
    [
        ("0.0.0.0", "0.0.0.0:8001", "127.0.0.1"),
        ("::", "[::]:8001", "127.0.0.1"),
        ("::1", "[::1]:8001", "::1"),
    ],
)
def test_host_opens_it_where_asked(host: str, listen: str, reached_at: str) -> None:
    assert router_listen(up("--host", host)) == listen
    assert reachable_host(host) == reached_at


def test_an_added_router_listens_where_the_first_does_and_a_wide_bind_is_warned_about(tmp_path: Path) -> None:
    args = up()
    env = ClusterEnv(args, tmp_path)
    assert " --listen 127.0.0.1:" in join_commands(args, env)["router"]
    assert "WARNING" not in banner(args, env, 1.0)
    wide = up("--host", "0.0.0.0")
    assert " --listen 0.0.0.0:" in join_commands(wide, env)["router"]
    assert "WARNING  the router listens on 0.0.0.0" in banner(wide, env, 1.0)
