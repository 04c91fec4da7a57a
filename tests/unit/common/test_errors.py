"""Every error's message is bounded where it is made, whatever code path built it (common/errors.py)."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import (
    _BY_CODE,
    MAX_MESSAGE_CHARS,
    Code,
    SluiceError,
    error_for_code,
)

CALLER_INPUT = "m" * 1_000_000
"""What a hostile caller might send as a model name, a version or a parameter value."""


@pytest.mark.parametrize("cls", [SluiceError, *_BY_CODE.values()], ids=lambda c: c.__name__)
def test_a_message_repeating_a_callers_input_is_cut_and_says_so(cls: type[SluiceError]) -> None:
    err = cls(f"unknown model {CALLER_INPUT!r}", reason="unknown_model")
    assert err.message.startswith("unknown model 'mmm")
    assert len(err.message) < MAX_MESSAGE_CHARS + 40
    assert err.message.endswith(f"... ({1_000_000 + 16 - MAX_MESSAGE_CHARS:,} more characters)")
    assert str(err) == err.message
    assert err.reason == "unknown_model"


def test_a_message_at_the_bound_is_kept_whole() -> None:
    exact = "x" * MAX_MESSAGE_CHARS
    assert SluiceError(exact).message == exact


@pytest.mark.parametrize("code", [Code.INTERNAL, Code.UNAVAILABLE, Code.DATA_LOSS, 99])
def test_a_message_from_across_a_process_boundary_is_cut_too(code: int) -> None:
    """A worker's item error (a model's exception text) or a peer's status is rebuilt here."""
    err = error_for_code(code, CALLER_INPUT, reason="worker_error")
    assert len(err.message) < MAX_MESSAGE_CHARS + 40
