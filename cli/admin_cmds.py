"""Operator commands over the admin RPCs: `sluice top`, `sluice tenants`, `sluice cache purge|stats`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from sluice_inference.cli.connect import add_connection_flags, aio_channel, channel, metadata
from sluice_inference.cli.parsing import (
    ADMIN_KEY,
    FROM_CONFIG,
    SubcommandParser,
    add_command,
    add_etcd_flags,
    subcommands,
)
from sluice_inference.common.cluster_auth import prove_router
from sluice_inference.common.cluster_proof import IdentityNotProven
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.etcd import ROUTERS, EtcdUnavailable, open_client
from sluice_inference.common.etcd_watch import decode_json_value
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2

T = TypeVar("T")
EXIT_OK, EXIT_BAD_ARGS, EXIT_CONNECTION, EXIT_RPC = 0, 1, 2, 3
CLEAR = "\x1b[H\x1b[2J"
CACHE_SETTINGS = (
    FROM_CONFIG.format(example="SLUICE_ETCD__ENDPOINTS")
    + " Routers are found in etcd; an admin API key from --api-key, else $SLUICE_API_KEY, goes only to a"
    " router that proved it is the one its record names, with the cluster token"
    " (SLUICE_CLUSTER__TOKEN_FILE) or, under cluster mTLS, a router certificate (SLUICE_CLUSTER__CA_FILE)."
)


def add_admin_parsers(sub: argparse._SubParsersAction[SubcommandParser]) -> None:
    """top, tenants and cache (purge, stats)."""
    top = add_command(
        sub,
        "top",
        "Show a router's lanes, rates, latencies and workers, refreshed in place.",
        ADMIN_KEY,
        "Ctrl-C quits; --once prints one frame and exits (scripts, tests).",
    )
    top.add_argument("--addr", default="localhost:8001", help="router HOST:PORT (default localhost:8001)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit (scripts, tests)")
    add_connection_flags(top)

    tenants = add_command(
        sub, "tenants", "Show the tenants' quotas and one router's usage of them.", ADMIN_KEY
    )
    tenants.add_argument("--addr", default="localhost:8001", help="router HOST:PORT (default localhost:8001)")
    tenants.add_argument("--json", action="store_true", help="print JSON")
    add_connection_flags(tenants)

    cache = add_command(
        sub,
        "cache",
        "Result-cache administration on every router: `sluice cache purge|stats`.",
        CACHE_SETTINGS,
    )
    cache_sub = subcommands(cache, "cache_command")
    purge = add_command(
        cache_sub,
        "purge",
        "Drop cached results of MODEL[:VERSION] on every router registered in etcd.",
        CACHE_SETTINGS,
    )
    purge.add_argument("model", metavar="MODEL[:VERSION]")
    add_etcd_flags(purge)
    add_connection_flags(purge)
    stats = add_command(
        cache_sub, "stats", "Print the cache counters of every router registered in etcd.", CACHE_SETTINGS
    )
    add_etcd_flags(stats)
    add_connection_flags(stats)


MAX_ADDR_CHARS = 256


async def _router_addrs(config: SluiceConfig) -> tuple[dict[str, str], int]:
    """Router id → address from etcd's `routers/`, and how many records were skipped (each named on
    stderr): a record is a claim, read as hostile input."""
    client = await open_client(config.etcd)
    try:
        found = await client.get_prefix((config.etcd.prefix + ROUTERS).encode())
    finally:
        await client.close()
    routers, skipped = {}, 0
    for kv in found:
        router_id = kv.key.decode(errors="replace").rsplit("/", 1)[-1]
        try:
            record = decode_json_value(kv.value, what="record")
            addr = record.get("addr") if isinstance(record, dict) else None
            if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS:
                raise ValueError("no usable 'addr' (a host:port string)")
        except ValueError as exc:
            skipped += 1
            print(f"{router_id[:64]!r}: skipped, malformed router record: {str(exc)[:200]}", file=sys.stderr)
            continue
        routers[router_id] = addr
    return routers, skipped


async def _call_router(
    config: SluiceConfig,
    args: argparse.Namespace,
    router_id: str,
    addr: str,
    call: Callable[[admin_pb2_grpc.RouterAdminAsyncStub, tuple[tuple[str, str], ...]], Awaitable[T]],
) -> T | None:
    """One admin call on a router found in etcd; the admin key goes only to a router that first proved it
    is `routers/<router_id>` (common/cluster_auth.prove_router). None, with the reason on stderr, when it
    did not or the call failed."""
    auth = metadata(args)
    try:
        async with aio_channel(args, addr) as opened:
            if auth:  # key-less local mode sends nothing secret: nothing to check first
                await prove_router(opened, router_id, config.cluster)
            return await call(admin_pb2_grpc.RouterAdminStub(opened), auth)
    except IdentityNotProven as exc:
        print(
            f"{router_id}: admin key not sent: {addr!r} did not prove it is router {router_id!r}: {exc}",
            file=sys.stderr,
        )
    except grpc.aio.AioRpcError as exc:
        print(f"{router_id}: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return None


async def cache_purge(config: SluiceConfig, args: argparse.Namespace) -> int:
    """Purge MODEL[:VERSION] on every router registered in etcd (each purges its memory; Redis once)."""
    model, _, version = args.model.partition(":")
    try:
        routers, failed = await _router_addrs(config)
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    if not routers:
        print("error: no router registered in etcd", file=sys.stderr)
        return EXIT_CONNECTION
    request = admin_pb2.PurgeCacheRequest(model=model, version=version)
    for router_id, addr in sorted(routers.items()):
        reply = await _call_router(
            config,
            args,
            router_id,
            addr,
            lambda stub, auth: stub.PurgeCache(request, timeout=10, metadata=auth),
        )
        if reply is None:
            failed += 1
            continue
        print(f"{router_id}: purged {reply.memory_entries} in memory, {reply.redis_entries} in Redis")
    return EXIT_RPC if failed else EXIT_OK


async def cache_stats(config: SluiceConfig, args: argparse.Namespace) -> int:
    """Print the cache counters of every live router (exit 3 if a record was malformed or a router did
    not answer)."""
    try:
        routers, failed = await _router_addrs(config)
    except EtcdUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    print(
        f"{'ROUTER':<28} {'HITS':>8} {'MISSES':>8} {'BYPASS':>7} {'EVICT':>7} {'ENTRIES':>8} {'MB':>7} REDIS"
    )
    request = admin_pb2.GetStatsRequest()
    for router_id, addr in sorted(routers.items()):
        stats = await _call_router(
            config, args, router_id, addr, lambda stub, auth: stub.GetStats(request, timeout=5, metadata=auth)
        )
        if stats is None:
            failed += 1
            continue
        c = stats.cache
        redis = "down" if c.redis_down else "ok"
        disabled = f"  disabled digests: {', '.join(c.disabled_digests)}" if c.disabled_digests else ""
        print(
            f"{router_id:<28} {c.hits:>8} {c.misses:>8} {c.bypasses:>7} {c.evictions:>7} {c.entries:>8} "
            f"{c.memory_bytes / 2**20:>7.1f} {redis}{disabled}"
        )
    return EXIT_RPC if failed else EXIT_OK


def tenants(args: argparse.Namespace) -> int:
    """Print tenant quotas and usage."""
    as_json = args.json
    with channel(args, args.addr) as opened:
        try:
            reply = admin_pb2_grpc.RouterAdminStub(opened).ListTenants(
                admin_pb2.ListTenantsRequest(), timeout=5, metadata=metadata(args)
            )
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_CONNECTION if exc.code() == grpc.StatusCode.UNAVAILABLE else EXIT_RPC
    if as_json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(reply), indent=2))
        return EXIT_OK
    print(
        f"quotas are cluster-wide, shared by {reply.routers} router(s) as their demand comes in; "
        "INFLIGHT is in flight here / this router's share of the cap"
    )
    print(
        f"{'TENANT':<16} {'RATE/s':>9} {'BURST':>7} {'INFLIGHT':>14} {'TOKENS':>8} {'WEIGHT':>6} "
        f"{'PRIO':>7} MODELS"
    )
    for t in reply.tenants:
        inflight = f"{t.inflight}/{t.inflight_share}"
        prio = f"{t.default_priority}(≥{t.max_priority})"
        print(
            f"{t.name:<16} {t.rate:>9.0f} {t.burst:>7} {inflight:>14} {t.tokens:>8.1f} {t.weight:>6.1f} "
            f"{prio:>7} {','.join(t.models)}"
        )
    return EXIT_OK


def _frame(stats: admin_pb2.RouterStats, workers: admin_pb2.ListWorkersResponse) -> str:
    lines = [
        f"sluice top — router {stats.router_id} ({stats.routers} router(s))  {time.strftime('%H:%M:%S')}",
        "",
    ]
    lines.append(
        f"{'MODEL':<14} {'REQ/S':>8} {'ERR%':>6} {'P50 MS':>8} {'P99 MS':>8} {'WORKERS':>8} {'DESIRED':>8}"
    )
    for m in stats.models:
        lines.append(
            f"{m.model:<14} {m.request_rate:>8.1f} {100 * m.error_ratio:>6.1f} "
            f"{m.p50_ms:>8.2f} {m.p99_ms:>8.2f} "
            f"{m.ready_workers:>8} {m.desired_workers:>8}"
        )
    lines += ["", f"{'LANE':<36} {'DEPTH':>6} {'OLDEST MS':>10} {'ROWS/S':>8}"]
    for lane in stats.lanes:
        name = f"{lane.model}:{lane.version}[{lane.shape}]"
        lines.append(
            f"{name:<36} {lane.depth:>6} {lane.oldest_age_s * 1000:>10.1f} {lane.arrival_rate:>8.1f}"
        )
    lines += ["", f"{'WORKER':<24} {'STATE':<9} {'IN FLIGHT':>9} {'QUEUED':>7} {'BUSY%':>6}"]
    for w in workers.workers:
        state = worker_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        lines.append(
            f"{w.worker_id:<24} {state:<9} {w.in_flight_batches:>9} {w.load.queued_batches:>7} "
            f"{100 * w.load.busy_fraction:>6.1f}"
        )
    c = stats.cache
    lines += ["", f"cache: {c.hits} hits, {c.misses} misses, {c.bypasses} bypasses, {c.entries} entries"]
    return "\n".join(lines)


def top(args: argparse.Namespace) -> int:
    """Refresh a live view until Ctrl-C (or one frame with --once)."""
    once, auth = args.once, metadata(args)
    with channel(args, args.addr) as opened:
        stub = admin_pb2_grpc.RouterAdminStub(opened)
        try:
            while True:
                stats = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=5, metadata=auth)
                workers = stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5, metadata=auth)
                print(("" if once else CLEAR) + _frame(stats, workers), flush=True)
                if once:
                    return EXIT_OK
                time.sleep(args.interval)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_CONNECTION if exc.code() == grpc.StatusCode.UNAVAILABLE else EXIT_RPC
        except KeyboardInterrupt:
            return EXIT_OK


def run_admin(args: argparse.Namespace, config: SluiceConfig) -> int:
    """Dispatch top / tenants / cache."""
    if args.command == "top":
        return top(args)
    if args.command == "tenants":
        return tenants(args)
    if args.cache_command == "purge":
        return asyncio.run(cache_purge(config, args))
    return asyncio.run(cache_stats(config, args))
