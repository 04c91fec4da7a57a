"""Client-side subcommands: health, infer, workers, drain, certs dev, models init."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from sluice_inference.cli.connect import channel, metadata
from sluice_inference.common.cluster_auth import DRAIN_METHOD, ClusterClient
from sluice_inference.common.cluster_proof import IdentityNotProven
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.etcd import WORKERS, EtcdUnavailable, open_client
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2
from sluice_inference.common.records import WorkerRecord
from sluice_inference.common.tensors import dtype_of

EXIT_OK, EXIT_CONNECTION, EXIT_RPC, EXIT_NOT_SERVING = 0, 2, 3, 4


def _connect(args: argparse.Namespace, addr: str, timeout: float) -> grpc.Channel | None:
    """A channel that completed its (TLS) handshake within `timeout`; None otherwise."""
    opened = channel(args, addr)
    try:
        grpc.channel_ready_future(opened).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        opened.close()
        return None
    return opened


def health(args: argparse.Namespace) -> int:
    """grpc_health_probe semantics: 0 SERVING, 2 cannot connect (or TLS handshake failed), 3 RPC failed,
    4 not SERVING."""
    addr, service, timeout = args.addr, args.service, args.timeout
    opened = _connect(args, addr, timeout)
    if opened is None:
        print(f"error: cannot connect to {addr} within {timeout:g} s", file=sys.stderr)
        return EXIT_CONNECTION
    with opened:
        try:
            stub: Any = health_pb2_grpc.HealthStub(opened)  # types-grpcio-health-checking omits Check
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"error: health check failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RPC
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"status: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING


def _random_input(
    tensor: kserve.ModelMetadataResponse.TensorMetadata, rng: np.random.Generator, length: int
) -> tuple[list[int], bytes]:
    shape = [1] + [length if d < 0 else d for d in tensor.shape[1:]]
    dtype = dtype_of(tensor.datatype, tensor=tensor.name)
    values: Any
    if dtype.kind == "f":
        values = rng.standard_normal(shape)
    elif dtype.kind in "iu":
        values = rng.integers(1, 100, size=shape)
    else:
        values = rng.integers(0, 2, size=shape)
    return shape, np.asarray(values, dtype=dtype).tobytes()


def infer(args: argparse.Namespace) -> int:
    """Send one request (random inputs from the model's metadata) and print the result."""
    if not args.random:
        print("error: only --random inputs are supported; pass --random", file=sys.stderr)
        return 1
    opened = _connect(args, args.addr, args.timeout)
    if opened is None:
        print(f"error: cannot connect to {args.addr}", file=sys.stderr)
        return EXIT_CONNECTION
    auth = metadata(args)
    with opened:
        stub = kserve_grpc.GRPCInferenceServiceStub(opened)
        try:
            meta = stub.ModelMetadata(
                kserve.ModelMetadataRequest(name=args.model, version=args.version),
                timeout=args.timeout,
                metadata=auth,
            )
            request = kserve.ModelInferRequest(model_name=args.model, model_version=args.version)
            rng = np.random.default_rng(args.seed)
            for tensor in meta.inputs:
                shape, data = _random_input(tensor, rng, args.length)
                request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
                request.raw_input_contents.append(data)
            start = time.perf_counter()
            response = stub.ModelInfer(request, timeout=args.timeout, metadata=auth)
            latency = time.perf_counter() - start
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RPC
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        array = np.frombuffer(raw, dtype=dtype_of(output.datatype)).reshape(list(output.shape))
        print(f"output {output.name} {output.datatype}{list(output.shape)}:")
        print(np.array2string(array, precision=4, threshold=64))
    params = response.parameters
    print(
        f"model {response.model_name} version {response.model_version} | "
        f"batch size {params['sluice_batch_size'].int64_param} | "
        f"worker {params['sluice_worker'].string_param} | latency {latency * 1000:.2f} ms"
    )
    return EXIT_OK


async def _worker_records(config: SluiceConfig) -> dict[str, WorkerRecord]:
    client = await open_client(config.etcd)
    try:
        prefix = config.etcd.prefix + WORKERS
        result = await client.get_prefix(prefix.encode())
    finally:
        await client.close()
    records = {}
    for kv in result:
        try:
            record = WorkerRecord.from_json(kv.value)
        except ValidationError as exc:
            print(f"warning: malformed record {kv.key!r}: {exc}", file=sys.stderr)
            continue
        records[record.worker_id] = record
    return records


def list_workers_via_router(args: argparse.Namespace) -> int:
    """The router's view: state, models, backlog, utilisation and learned estimates per worker."""
    with channel(args, args.addr) as opened:
        try:
            reply = admin_pb2_grpc.RouterAdminStub(opened).ListWorkers(
                admin_pb2.ListWorkersRequest(), timeout=5, metadata=metadata(args)
            )
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_CONNECTION if exc.code() == grpc.StatusCode.UNAVAILABLE else EXIT_RPC
    header = f"{'WORKER':<22} {'STATE':<9} {'STREAM':<7} {'IN FLIGHT':>9} {'QUEUED':>7} {'BUSY%':>6}"
    print(header + "  ESTIMATES t(1) / t(max)")
    for w in reply.workers:
        state = worker_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        stream = "broken" if w.breaker_open else ("open" if w.connected else "-")
        estimates = ", ".join(
            f"{e.model}:{e.version} {e.seconds_one * 1e3:.1f}/{e.seconds_full * 1e3:.1f}ms@{e.max_batch_size}"
            for e in w.estimates
        )
        print(
            f"{w.worker_id:<22} {state:<9} {stream:<7} {w.in_flight_batches:>9} {w.load.queued_batches:>7} "
            f"{100 * w.load.busy_fraction:>6.1f}  {estimates}"
        )
    print(f"{len(reply.workers)} worker(s)")
    return EXIT_OK


async def list_workers(config: SluiceConfig, *, as_json: bool) -> int:
    """Print the workers registered in etcd with their models and state."""
    try:
        records = await _worker_records(config)
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in records.values()], indent=2))
        return EXIT_OK
    print(f"{'WORKER':<24} {'STATE':<9} {'DEVICE':<7} {'ADDRESS':<22} MODELS")
    for record in sorted(records.values(), key=lambda r: r.worker_id):
        models = ", ".join(f"{m.name}:{m.version}" for m in record.models)
        print(f"{record.worker_id:<24} {record.state:<9} {record.device:<7} {record.addr:<22} {models}")
    print(f"{len(records)} worker(s)")
    return EXIT_OK


async def drain(config: SluiceConfig, worker_id: str, wait_s: float) -> int:
    """Ask a worker (found in etcd) to drain, presenting the cluster credentials of `config`."""
    try:
        records = await _worker_records(config)
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    record = records.get(worker_id)
    if record is None:
        print(
            f"error: no worker {worker_id!r} in etcd (known: {', '.join(sorted(records))})", file=sys.stderr
        )
        return 1
    cluster = ClusterClient(config.cluster)  # without credentials the worker refuses: UNAUTHENTICATED
    try:
        async with cluster.channel(record.addr, worker_id) as opened:
            # The worker proves it is `worker_id` before anything that proves who we are is sent.
            metadata = await cluster.authenticate(opened, worker_id, DRAIN_METHOD)
            reply = await admin_pb2_grpc.WorkerAdminStub(opened).Drain(
                admin_pb2.DrainRequest(wait_s=wait_s), timeout=wait_s + 5.0, metadata=metadata
            )
    except IdentityNotProven as exc:
        print(
            f"error: {record.addr[:128]!r} did not prove it is worker {worker_id!r}: {exc}", file=sys.stderr
        )
        return EXIT_RPC
    except grpc.aio.AioRpcError as exc:
        print(f"error: drain failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_RPC
    state = worker_pb2.WorkerState.Name(reply.state)
    print(f"worker {worker_id}: {state}, {reply.in_flight_batches} batch(es) in flight")
    return EXIT_OK


def hash_key(key: str) -> int:
    """Print the stored form of an API key."""
    from sluice_inference.router.policy.tenants import hash_api_key

    if not key:
        print("error: empty key", file=sys.stderr)
        return 1
    print(hash_api_key(key))
    return EXIT_OK


def certs_dev(directory: Path, worker_ids: tuple[str, ...] = ()) -> int:
    """Write the development CA and certificates (common/dev_certs.py); with `worker_ids` and a CA already
    in `directory`, only those workers' certificates, from that CA."""
    from sluice_inference.common.dev_certs import issue_worker_certificate, write_dev_certs

    try:
        if worker_ids and (directory / "ca-key.pem").exists():
            written = [
                path for worker_id in worker_ids for path in issue_worker_certificate(directory, worker_id)
            ]
        else:
            written = write_dev_certs(directory, worker_ids)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    print("development use only: the CA key (ca-key.pem) can sign anything these files trust")
    return EXIT_OK


def models_init(repository: Path, *, gpu: bool = False) -> int:
    """Write the demo model repository (`gpu`: the transformer-sized models instead)."""
    if gpu:
        from sluice_inference.worker.demo_transformer import init_gpu_repository

        written = init_gpu_repository(repository)
    else:
        from sluice_inference.worker.demo_models import init_demo_repository

        written = init_demo_repository(repository)
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK
