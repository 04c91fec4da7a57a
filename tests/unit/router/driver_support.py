"""The router's driver with fake worker links, for tests of the driver and of what runs beside it (the
status pass, the one-core tests): a link that records what is sent and answers if told to, a driver
over a real core, and one request through it."""

from __future__ import annotations

import asyncio

import numpy as np
from pydantic import SecretStr

from sluice_inference.common.batch_tensors import pack_arrays
from sluice_inference.common.clock import Clock, MonotonicClock
from sluice_inference.common.cluster_auth import ClusterClient
from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.common.trust_settings import ClusterSettings
from sluice_inference.router.codec import DecodedRequest, decode_call
from sluice_inference.router.driver import Driver
from sluice_inference.router.kserve_codec import call_from_request
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.batcher import Batcher, TimerBatcher
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.tenants import Tenant
from sluice_inference.router.worker_link import WorkerLink, WorkerLinks

RECORD = ModelRecord(
    name="mlp",
    version="1",
    digest="sha256:00",
    platform="torch_export",
    max_batch_size=8,
    max_wait_s=0.0,
    inputs=(TensorSpec(name="input", datatype="FP32", dims=(4,)),),
    outputs=(TensorSpec(name="output", datatype="FP32", dims=(2,)),),
)
UNUSED_CLUSTER = ClusterClient(ClusterSettings(token=SecretStr("unused-by-fake-links")))
"""A fake link never dials; it only needs something to hold."""
TENANT = Tenant("gold", TenantSettings(rate=1e6, burst=10**6, max_inflight=10**6))


class FakeLink(WorkerLink):
    """The router's end of a stream, without the stream: records what is sent; answers if told to."""

    def __init__(
        self, worker_id: str, driver: Driver | None = None, *, fail_sends: int = 0, busy: int = 0
    ) -> None:
        super().__init__(
            worker_id,
            "unused:0",
            on_message=lambda *_: None,
            on_up=lambda *_: None,
            on_closed=lambda *_: None,
            cluster=UNUSED_CLUSTER,
            clock=MonotonicClock(),
        )
        self.driver = driver
        self.fail_sends = fail_sends
        self.busy = busy
        """How many batches to refuse `worker_busy` (with a full queue) before running any."""
        self.sent: list[worker_pb2.RouterMessage] = []
        self.closed_by_router = False

    def send(self, message: worker_pb2.RouterMessage) -> bool:
        if message.batches and self.fail_sends:
            self.fail_sends -= 1
            raise RuntimeError("the stream's writer blew up")
        self.sent.append(message)
        if message.batches and self.driver is not None:
            answer = worker_pb2.WorkerMessage(results=[self._answer(batch) for batch in message.batches])
            asyncio.get_running_loop().call_soon(self.driver.on_message, self.worker_id, answer)
        return True

    def _answer(self, batch: worker_pb2.Batch) -> worker_pb2.BatchResult:
        if self.busy:
            self.busy -= 1
            result = worker_pb2.BatchResult(batch_id=batch.batch_id, queued_batches=4)
            for item_id in batch.item_ids:
                refusal = worker_pb2.ItemError(
                    item_id=item_id, code=int(Code.UNAVAILABLE), message="busy", reason="worker_busy"
                )
                result.errors.append(refusal)
            return result
        rows = list(batch.item_rows)
        output = np.zeros((sum(rows), 2), "<f4")
        return worker_pb2.BatchResult(
            batch_id=batch.batch_id,
            executed_size=sum(rows),
            item_ids=batch.item_ids,
            item_rows=rows,
            outputs=[pack_arrays("output", [output])],
        )

    async def close(self) -> None:
        self.closed_by_router = True

    def cancelled_items(self) -> list[int]:
        return [i for m in self.sent if m.HasField("cancel") for i in m.cancel.item_ids]


def decoded(record: ModelRecord = RECORD, value: float = 0.0) -> DecodedRequest:
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.full((1, 4), value, "<f4").tobytes())
    return decode_call(call_from_request(request, metadata=None, time_remaining_s=None), record)


def make_driver(
    links: WorkerLinks,
    *,
    worker_hang_s: float = 5.0,
    batcher: Batcher | None = None,
    clock: Clock | None = None,
) -> Driver:
    clock = clock or MonotonicClock()
    core = RouterCore(
        clock.now(),
        settings=RouterSettings(worker_hang_s=worker_hang_s, watchdog_s=2.0),
        admission=AdmissionSettings(),
        tenants={TENANT.name: TENANT.settings},
        batcher=batcher or TimerBatcher(),
    )
    return Driver(clock, core, links, RouterMetrics())


def join(driver: Driver, *worker_ids: str) -> None:
    for worker_id in worker_ids:
        driver.worker_registered(worker_id, {("mlp", "1"): {}}, 2, True, "cuda")
        driver.worker_connected(worker_id, True)


async def infer(driver: Driver, timeout_s: float = 5.0) -> Code:
    try:
        now = driver.clock.now()
        await driver.infer(decoded(), now + timeout_s, TENANT, 1, arrival=now)
    except SluiceError as err:
        return err.code
    return Code.OK
