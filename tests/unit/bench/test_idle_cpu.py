"""`bench/idle_cpu.py`'s `--beside VAR=VALUE`: the variable of the second cluster, parsed strictly."""

from __future__ import annotations

import argparse

import pytest

from sluice_inference.bench.idle_cpu import beside


def test_beside_takes_a_variable_and_its_value_which_may_hold_equals_signs_or_be_empty() -> None:
    assert beside("GOMAXPROCS=2") == ("GOMAXPROCS", "2")
    assert beside("GODEBUG=a=1,b=2") == ("GODEBUG", "a=1,b=2")
    assert beside("EMPTY=") == ("EMPTY", "")


@pytest.mark.parametrize("text", ["GOMAXPROCS", "=2", ""])
def test_beside_refuses_anything_but_var_equals_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="VAR=VALUE"):
        beside(text)
