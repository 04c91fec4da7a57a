"""The data plane on domain objects, with the real cache and idempotency gates and in-process stores; only
the driver is a fake (tests/support/dataplane.py). No protobuf of the client transport appears here: this
is what a second transport would reuse."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable

import numpy as np
import pytest

from sluice_inference.common.errors import Code, Internal, InvalidArgument, SluiceError, Unavailable
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.calls import CacheOutcome, InputTensor
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.policy.tenants import hash_api_key
from tests.support.dataplane import GOLD_KEY, make_plane, mlp, raw_call

ROW = [1.0, 2.0, 3.0, 4.0]


async def refused(pending: Awaitable[object]) -> SluiceError:
    with pytest.raises(SluiceError) as caught:
        await pending
    return caught.value


async def test_a_hit_answers_with_the_bytes_of_the_miss_and_never_reaches_the_driver() -> None:
    made = make_plane()
    miss = await made.plane.infer(raw_call(ROW, id="first"))
    hit = await made.plane.infer(raw_call(ROW, id="second"))
    assert len(made.backend.calls) == 1
    assert (miss.cache, hit.cache) == (CacheOutcome.MISS, CacheOutcome.HIT)
    assert hit.outputs == miss.outputs
    assert hit.outputs[0].data == (np.asarray([ROW], "<f4") * 2).tobytes()
    assert (hit.id, hit.served, hit.model_version) == ("second", None, "1")
    assert miss.served is not None and miss.served.worker_id == "fake-1"
    assert made.audit.hits == [hit]  # hits, and only hits, go to the auditor


async def test_typed_values_hit_the_entry_that_the_same_raw_call_stored() -> None:
    made = make_plane()
    await made.plane.infer(raw_call(ROW))
    typed = raw_call(ROW, inputs=(InputTensor("x", "FP32", (1, 4), values=ROW),))
    assert (await made.plane.infer(typed)).cache is CacheOutcome.HIT
    assert len(made.backend.calls) == 1


async def test_requested_outputs_come_back_in_the_order_asked() -> None:
    made = make_plane()
    result = await made.plane.infer(raw_call(ROW, outputs=("s", "y")))
    assert [t.name for t in result.outputs] == ["s", "y"]
    assert result.outputs[0].data == np.asarray([[10.0]], "<f4").tobytes()


async def test_an_idempotent_replay_after_a_version_roll_returns_the_stored_result() -> None:
    made = make_plane(mlp("1"))
    first = await made.plane.infer(raw_call(ROW, id="a", idempotency_key="order-7"))
    made.roll_out(mlp("1"), mlp("2"))
    replay = await made.plane.infer(raw_call(ROW, id="b", idempotency_key="order-7"))
    assert replay.replayed and not first.replayed
    assert (replay.model_version, replay.id) == ("1", "b")
    assert replay.outputs == first.outputs and replay.served == first.served
    assert replay.cache is first.cache is CacheOutcome.MISS
    assert len(made.backend.calls) == 1
    fresh = await made.plane.infer(raw_call(ROW, id="c"))  # without the key: the new version answers
    assert fresh.model_version == "2" and fresh.outputs != first.outputs


async def test_a_key_reused_for_another_request_is_failed_precondition() -> None:
    made = make_plane()
    await made.plane.infer(raw_call(ROW, idempotency_key="k"))
    err = await refused(made.plane.infer(raw_call([9.0, 9.0, 9.0, 9.0], idempotency_key="k")))
    assert (err.code, err.reason) == (Code.FAILED_PRECONDITION, "idempotency_key_reused")
    assert len(made.backend.calls) == 1


async def test_a_terminal_failure_is_replayed_and_a_retryable_one_runs_again() -> None:
    made = make_plane()
    made.backend.errors = [Internal("the model raised", reason="model_error")]
    first = await refused(made.plane.infer(raw_call(ROW, idempotency_key="t")))
    again = await refused(made.plane.infer(raw_call(ROW, idempotency_key="t")))
    assert (first.code, again.code, again.reason) == (Code.INTERNAL, Code.INTERNAL, "replayed_error")
    assert len(made.backend.calls) == 1
    made.backend.errors = [Unavailable("no worker", reason="no_worker", retry_after_s=0.1)]
    shed = await refused(made.plane.infer(raw_call([5.0] * 4, idempotency_key="r")))
    assert shed.code == Code.UNAVAILABLE
    retried = await made.plane.infer(raw_call([5.0] * 4, idempotency_key="r"))
    assert not retried.replayed and len(made.backend.calls) == 3


async def test_the_budget_holds_body_then_inputs_and_twice_the_response_and_gets_all_of_it_back() -> None:
    made = make_plane()
    held: list[tuple[int, DecodedRequest]] = []
    made.backend.during = lambda decoded: held.append((made.budget.used, decoded))
    call = raw_call(ROW)
    await made.plane.infer(call)
    ((used, decoded),) = held
    assert used == call.body_bytes + decoded.input_bytes + 2 * decoded.response_bytes
    assert made.budget.used == 0
    made.backend.errors = [Unavailable("no worker", reason="no_worker")]
    await refused(made.plane.infer(raw_call([7.0] * 4)))
    assert made.budget.used == 0


async def test_a_body_over_the_budget_is_refused_before_any_other_work() -> None:
    made = make_plane(inflight_bytes=1024 * 1024)
    err = await refused(made.plane.infer(raw_call(ROW, body_bytes=2 * 1024 * 1024, model_name="nope")))
    assert (err.code, err.reason) == (Code.RESOURCE_EXHAUSTED, "inflight_bytes")  # before NOT_FOUND
    assert made.backend.calls == [] and made.budget.used == 0


async def test_an_answer_ready_after_the_deadline_is_deadline_exceeded_yet_kept_for_a_retry() -> None:
    made = make_plane()
    made.backend.delay_s = 2.0
    late = await refused(made.plane.infer(raw_call(ROW, time_remaining_s=1.0, idempotency_key="slow")))
    assert (late.code, late.reason) == (Code.DEADLINE_EXCEEDED, "finished_late")
    retried = await made.plane.infer(raw_call(ROW, time_remaining_s=1.0, idempotency_key="slow"))
    assert retried.replayed and len(made.backend.calls) == 1  # the work was done once; the retry gets it


async def test_a_transport_defect_is_reported_where_validation_checks_payloads() -> None:
    made = make_plane()
    unpaired = dataclasses.replace(raw_call(ROW).inputs[0], data=None)
    flagged = raw_call(
        ROW, inputs=(unpaired,), defect=InvalidArgument("buffers do not pair", reason="bad_inputs")
    )
    unknown = await refused(made.plane.infer(dataclasses.replace(flagged, model_name="nope")))
    assert unknown.code == Code.NOT_FOUND  # the model is resolved before payloads are looked at
    err = await refused(made.plane.infer(flagged))
    assert (err.code, err.reason, err.message) == (Code.INVALID_ARGUMENT, "bad_inputs", "buffers do not pair")
    assert made.backend.calls == []


async def test_a_parameter_named_without_a_value_is_refused_like_a_wrong_one() -> None:
    made = make_plane()
    err = await refused(made.plane.infer(raw_call(ROW, parameters={"priority": None})))
    assert (err.code, err.reason) == (Code.INVALID_ARGUMENT, "bad_priority")
    err = await refused(made.plane.infer(raw_call(ROW, parameters={"timeout": None})))
    assert (err.code, err.reason) == (Code.INVALID_ARGUMENT, "bad_timeout")


async def test_tenants_are_authenticated_and_scoped() -> None:
    made = make_plane()
    err = await refused(made.plane.infer(raw_call(ROW, api_key="wrong")))
    assert (err.code, err.reason) == (Code.UNAUTHENTICATED, "unknown_key")
    await made.plane.infer(raw_call(ROW, api_key=GOLD_KEY))
    other_tenant = await made.plane.infer(raw_call(ROW))  # anonymous: its own cache scope
    assert other_tenant.cache is CacheOutcome.MISS


async def test_a_bug_behind_the_data_plane_ends_only_that_call_as_internal_counted_once() -> None:
    made = make_plane()
    made.backend.errors = [RuntimeError("a bug")]
    err = await refused(made.plane.infer(raw_call(ROW, idempotency_key="bug")))
    assert (err.code, err.reason) == (Code.INTERNAL, "internal")
    assert made.requests("mlp", "INTERNAL") == 1
    assert not (await made.plane.infer(raw_call(ROW, idempotency_key="bug"))).replayed  # key was released
    assert made.requests("mlp", "OK") == 1 and made.budget.used == 0


def test_model_queries_check_the_key_then_the_tenants_models_then_the_name() -> None:
    limited = TenantSettings(api_keys=[hash_api_key("l-key")], models=["mlp"])
    made = make_plane(tenants={"limited": limited})
    with pytest.raises(SluiceError) as caught:
        made.plane.model(None, "mlp", "")
    assert caught.value.reason == "missing_key"
    with pytest.raises(SluiceError) as caught:
        made.plane.model("l-key", "no-such-model", "")
    assert caught.value.code == Code.PERMISSION_DENIED  # says nothing about whether it exists
    record = made.plane.model("l-key", "mlp", "")
    assert made.plane.model_ready(record) and made.plane.versions("mlp") == ["1"]
    made.roll_out(mlp("2"))
    assert not made.plane.model_ready(record)


async def test_inference_checks_the_tenants_models_before_it_says_whether_a_model_exists() -> None:
    limited = TenantSettings(api_keys=[hash_api_key("l-key")], models=["mlp"])
    made = make_plane(tenants={"limited": limited})
    for name in ("no-such-model", "other"):
        err = await refused(made.plane.infer(raw_call(ROW, api_key="l-key", model_name=name)))
        assert (err.code, err.reason) == (Code.PERMISSION_DENIED, "model_denied")
    assert (await made.plane.infer(raw_call(ROW, api_key="l-key"))).model_name == "mlp"


async def test_the_queue_is_handed_the_whole_budget_the_client_gave_from_when_the_call_arrived() -> None:
    """Admission judges `deadline - arrival` against the model's best case: the router's own delays
    between the call's arrival and its queueing must not shrink it (docs/admission.md)."""
    made = make_plane()
    start = made.clock.now()
    await made.plane.infer(raw_call(ROW, time_remaining_s=0.25))
    [(arrival, deadline)] = made.backend.budgets
    assert arrival == start and deadline == pytest.approx(start + 0.25)
