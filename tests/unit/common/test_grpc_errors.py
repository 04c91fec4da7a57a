"""The error boundary: retry hints travel as RetryInfo and pushback; terminal errors say -1; a refusal that
repeats is answered with the trailers built the first time."""

from __future__ import annotations

from google.rpc import error_details_pb2, status_pb2

from sluice_inference.common.errors import Code, InvalidArgument, Unavailable, error_for_code
from sluice_inference.common.grpc_errors import (
    DETAILS_KEY,
    MAX_REMEMBERED_MESSAGE_CHARS,
    PUSHBACK_KEY,
    REASON_KEY,
    grpc_code,
    trailers_for,
)


def test_retryable_error_carries_both_hints() -> None:
    trailers = dict(trailers_for(Unavailable("queue full", reason="queue_full", retry_after_s=0.25)))
    assert trailers[PUSHBACK_KEY] == "250"
    status = status_pb2.Status.FromString(trailers[DETAILS_KEY])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 250
    assert status.code == Code.UNAVAILABLE


def test_terminal_error_forbids_retry() -> None:
    trailers = dict(trailers_for(InvalidArgument("bad shape", retry_after_s=5)))
    assert trailers[PUSHBACK_KEY] == "-1"
    assert not status_pb2.Status.FromString(trailers[DETAILS_KEY]).details


def test_codes_survive_a_process_boundary() -> None:
    err = error_for_code(int(Code.UNAVAILABLE), "worker lost", retry_after_s=0.1)
    assert isinstance(err, Unavailable) and err.retry_after_s == 0.1
    assert error_for_code(int(Code.ABORTED), "x").code == Code.ABORTED


def test_every_code_maps_to_the_grpc_status_of_its_number() -> None:
    for code in Code:
        assert grpc_code(code).value[0] == int(code)


def test_repeated_refusals_share_their_trailers_and_each_keeps_its_own_hint_and_reason() -> None:
    first = trailers_for(Unavailable("queue full", reason="queue_full", retry_after_s=0.25))
    again = trailers_for(Unavailable("queue full", reason="queue_full", retry_after_s=0.25))
    assert again is first  # built once
    later = dict(trailers_for(Unavailable("queue full", reason="queue_full", retry_after_s=0.5)))
    assert later[PUSHBACK_KEY] == "500"
    other = dict(trailers_for(Unavailable("queue full", reason="shed", retry_after_s=0.25)))
    assert other[REASON_KEY] == "shed" and other[PUSHBACK_KEY] == "250"
    message = status_pb2.Status.FromString(dict(trailers_for(InvalidArgument("bad dims")))[DETAILS_KEY])
    assert message.message == "bad dims" and message.code == Code.INVALID_ARGUMENT


def test_a_long_message_is_answered_whole_and_never_remembered() -> None:
    long = InvalidArgument("x" * (MAX_REMEMBERED_MESSAGE_CHARS + 1))
    first, again = trailers_for(long), trailers_for(long)
    assert again is not first and again == first
    assert status_pb2.Status.FromString(dict(first)[DETAILS_KEY]).message == long.message
