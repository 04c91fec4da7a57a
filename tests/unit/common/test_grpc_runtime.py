"""The gRPC I/O mode of Sluice's processes (common/grpc_runtime.py), each case in a fresh interpreter: the
C core reads `GRPC_EXPERIMENTS` once, when `grpc` is first imported, so what matters is the environment at
that moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sluice_inference.common.grpc_runtime import IO_ON_POLLING_THREAD

PROBE = """
import json, os, sys
import sluice_inference.cli  # what every `sluice` command imports first
before_grpc = "grpc" not in sys.modules
import sluice_inference.cli.main  # the command itself, which imports grpc
print(json.dumps({"experiments": os.environ.get("GRPC_EXPERIMENTS"), "set_before_grpc": before_grpc,
                  "grpc_loaded": "grpc" in sys.modules}))
"""


def _probe(**env: str) -> dict[str, object]:
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True, env=environment)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_sluice_command_sets_the_io_mode_before_grpc_is_imported() -> None:
    state = _probe()
    assert state["experiments"] == IO_ON_POLLING_THREAD
    assert state["set_before_grpc"]  # else the C core would already have read its defaults
    assert state["grpc_loaded"]


def test_an_operators_own_setting_wins_even_an_empty_one() -> None:
    assert _probe(GRPC_EXPERIMENTS="-event_engine_client")["experiments"] == "-event_engine_client"
    assert _probe(GRPC_EXPERIMENTS="")["experiments"] == ""
