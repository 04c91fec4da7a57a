"""`sluice`: argument parsing and dispatch. Each subcommand's work lives in its own module.

Exit codes follow grpc_health_probe for every subcommand: 0 success, 1 bad arguments, 2 connection
failure, 3 RPC failure, 4 not SERVING (health only).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, NoReturn

from cli.admin_cmds import add_admin_parsers, run_admin
from cli.bench_cmd import add_bench_parser, run_bench
from cli.connect import add_connection_flags
from cli.sim_cmd import add_sim_parser, run_sim
from common.config import ConfigError, SluiceConfig, load_config
from common.logs import configure_logging

EXIT_BAD_ARGS = 1
# What a slim install (client, CLI, router) leaves out, and the extra that brings it: `sluice worker` and
# `sluice models init` need torch.
_EXTRAS = {"torch": "worker", "onnx": "onnx", "onnxruntime": "onnx"}


class _Parser(argparse.ArgumentParser):
    """argparse, but bad arguments exit 1 as grpc_health_probe does (2 means 'cannot connect')."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_ARGS, f"{self.prog}: error: {message}\n")


def _add_etcd_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", metavar="HOST:PORT", help="etcd endpoint (default: config, else 127.0.0.1:2379)")
    p.add_argument("--prefix", help="etcd key prefix (default: /sluice/)")


def _add_process_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The long-running processes: up, router, worker."""
    up = sub.add_parser("up", help="run a local cluster: etcd, a router and workers; Ctrl-C stops it all")
    up.add_argument(
        "--repository", type=Path, default=Path("models"), help="model repository (default models/)"
    )
    up.add_argument("--workers", type=int, default=2, help="worker processes to start (default 2)")
    up.add_argument(
        "--router-processes",
        type=int,
        default=1,
        help="router processes sharing the port (`sluice router --processes`; default 1)",
    )
    up.add_argument("--port", type=int, default=8001, help="router gRPC port (default 8001)")
    up.add_argument("--metrics-port", type=int, default=8002, help="router /metrics port (default 8002)")
    up.add_argument(
        "--etcd-port", type=int, default=2379, help="client port of the local etcd (default 2379)"
    )
    up.add_argument("--log-dir", type=Path, help="write each process's log to a file here instead of stderr")
    up.add_argument(
        "--redis-port", type=int, help="also start a local Valkey (Redis) on this port for the router"
    )
    up.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for readiness")
    up.add_argument(
        "--tls",
        action="store_true",
        help="TLS everywhere: client port, etcd, and mTLS between router and workers (development CA)",
    )
    up.add_argument(
        "--certs",
        type=Path,
        help="with --tls: use (or write, if empty) the `sluice certs dev` files here (default: per run)",
    )

    router = sub.add_parser("router", help="run a router (KServe v2 gRPC front end)")
    router.add_argument("--listen", help="gRPC bind address (default 0.0.0.0:8001)")
    router.add_argument("--metrics-port", type=int, help="/metrics port (default 8002; 0 picks one)")
    router.add_argument("--router-id", help="name in etcd (default hostname-pid-port)")
    router.add_argument(
        "--processes",
        type=int,
        default=1,
        help="serve the port from N router processes, one core each (SO_REUSEPORT; default 1)",
    )
    _add_etcd_flags(router)

    worker = sub.add_parser("worker", help="run a worker that owns one device")
    worker.add_argument("--repository", type=Path, help="model repository root (default models/)")
    worker.add_argument("--models", help="comma-separated model names to load (default: all)")
    worker.add_argument("--device", help="cpu or cuda:N (default cpu)")
    worker.add_argument("--torch-threads", type=int, help="torch intra-op threads (default 1)")
    worker.add_argument("--listen", help="gRPC bind address (default 127.0.0.1:0, a free port)")
    worker.add_argument("--advertise-host", help="host routers dial (default 127.0.0.1)")
    worker.add_argument("--metrics-port", type=int, help="/metrics port (default 0: pick one)")
    worker.add_argument("--worker-id", help="name in etcd (default hostname-pid)")
    _add_etcd_flags(worker)


def _add_client_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """Commands that talk to a running cluster: health, infer, workers, drain."""
    health = sub.add_parser(
        "health", help="grpc.health.v1 probe; exit 0 SERVING, 2 no connection, 4 not SERVING"
    )
    health.add_argument("addr", help="HOST:PORT of a router or worker")
    health.add_argument("--service", default="", help="service name (default '': the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    add_connection_flags(health, api_key=False)

    infer = sub.add_parser("infer", help="send one inference request and print the result")
    infer.add_argument("--model", required=True, help="model name")
    infer.add_argument("--version", default="", help="model version (default: latest ready)")
    infer.add_argument("--addr", default="localhost:8001", help="router HOST:PORT (default localhost:8001)")
    infer.add_argument("--random", action="store_true", help="fill every input with random values")
    infer.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    infer.add_argument("--length", type=int, default=8, help="size used for variable dims (default 8)")
    infer.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds (default 10)")
    add_connection_flags(infer)

    workers = sub.add_parser("workers", help="list workers registered in etcd")
    workers.add_argument("--json", action="store_true", help="print the raw records as JSON")
    workers.add_argument(
        "--addr", help="ask this router instead of etcd: adds backlog, utilisation and learned estimates"
    )
    _add_etcd_flags(workers)
    add_connection_flags(workers)

    drain = sub.add_parser(
        "drain",
        help="drain a worker: finish in-flight work, deregister, exit (presents the config's cluster "
        "token or client certificate)",
    )
    drain.add_argument("worker_id", metavar="WORKER", help="worker id as `sluice workers` shows it")
    drain.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the drain to finish")
    _add_etcd_flags(drain)


def _add_tool_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """Offline tools: keys, models, bench."""
    keys = sub.add_parser("keys", help="API key tools")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, parser_class=_Parser)
    hash_key = keys_sub.add_parser(
        "hash", help="print the sha256:<hex> form of an API key (tenants.api_keys)"
    )
    hash_key.add_argument("key", help="the API key (keep it out of shell history: pass '-' to read stdin)")

    certs = sub.add_parser("certs", help="TLS certificate tools")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, parser_class=_Parser)
    dev = certs_sub.add_parser(
        "dev",
        help="write a development CA and router, worker, etcd and client certificates (not for production)",
    )
    dev.add_argument("directory", type=Path, metavar="DIR", help="where to write them (created if missing)")

    models = sub.add_parser("models", help="model repository tools")
    models_sub = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    init = models_sub.add_parser("init", help="write the demo models (mlp, encoder, synthetic), fixed seeds")
    init.add_argument("--repository", type=Path, default=Path("models"), help="where (default models/)")
    check = models_sub.add_parser(
        "check",
        help="validate a repository offline (config.yaml and Triton config.pbtxt) and print what each model "
        "will be served as; exit 1 on any problem",
    )
    check.add_argument("repository", type=Path, metavar="DIR", help="the model repository")
    check.add_argument(
        "--no-load", action="store_true", help="check configs and layout only, without loading artifacts"
    )
    add_bench_parser(sub)
    add_sim_parser(sub)
    add_admin_parsers(sub, _add_etcd_flags, _Parser)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sluice", description="Sluice: an inference-serving cluster (KServe v2 gRPC).")
    parser.add_argument("--config", type=Path, help="sluice.yaml (then SLUICE_* env vars, then flags, win)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument(
        "--log-format", choices=("json", "text"), default="json", help="json lines (default) or plain text"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_process_commands(sub)
    _add_client_commands(sub)
    _add_tool_commands(sub)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags that were given, as a config tree (flags win over file and environment)."""
    tree: dict[str, dict[str, Any]] = {"etcd": {}, "router": {}, "worker": {}}
    if getattr(args, "etcd", None):
        tree["etcd"]["endpoints"] = [args.etcd]
    if getattr(args, "prefix", None):
        tree["etcd"]["prefix"] = args.prefix
    section = {"router": "router", "worker": "worker"}.get(args.command)
    if section:
        for flag in ("listen", "metrics_port", "router_id", "repository", "device", "torch_threads",
                     "advertise_host", "worker_id"):  # fmt: skip
            value = getattr(args, flag, None)
            if value is not None:
                tree[section][flag] = value
        if getattr(args, "models", None):
            tree["worker"]["models"] = [m for m in args.models.split(",") if m]
    return tree


def _config(args: argparse.Namespace) -> SluiceConfig:
    return load_config(args.config, overrides=_overrides(args))


def _run_offline(args: argparse.Namespace) -> int | None:
    """Commands that need no cluster configuration; None for the others."""
    from cli import commands

    if args.command == "models" and args.models_command == "check":
        from cli.models_check import check_repository

        return check_repository(args.repository, load=not args.no_load)
    if args.command == "models":
        return commands.models_init(args.repository)
    if args.command == "keys":
        return commands.hash_key(sys.stdin.readline().strip() if args.key == "-" else args.key)
    if args.command == "health":
        return commands.health(args)
    if args.command == "certs":
        return commands.certs_dev(args.directory)
    if args.command == "infer":
        return commands.infer(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "sim":
        return run_sim(args)
    if args.command == "up":
        from cli.cluster import run_local_cluster

        return run_local_cluster(args)
    return None


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from cli import commands

    offline = _run_offline(args)
    if offline is not None:
        return offline
    config = _config(args)
    if args.command == "router" and args.processes != 1:
        return _router_processes(args, argv, config)
    if args.command == "router":
        from router.main import serve_router

        asyncio.run(serve_router(config))
        return 0
    if args.command == "worker":
        from worker.main import serve_worker

        asyncio.run(serve_worker(config))
        return 0
    if args.command == "workers":
        if args.addr:
            return commands.list_workers_via_router(args)
        return asyncio.run(commands.list_workers(config, as_json=args.json))
    if args.command in ("top", "tenants", "cache"):
        return run_admin(args, config)
    if args.command == "drain":
        return asyncio.run(commands.drain(config, args.worker_id, args.wait))
    raise AssertionError(args.command)


def _router_processes(args: argparse.Namespace, argv: list[str], config: SluiceConfig) -> int:
    from cli.router_processes import run_router_processes

    if args.processes < 1:
        print("sluice router: --processes must be at least 1", file=sys.stderr)
        return EXIT_BAD_ARGS
    if config.router.listen.rsplit(":", 1)[-1] == "0":
        print("sluice router: --processes needs a fixed listen port (not :0)", file=sys.stderr)
        return EXIT_BAD_ARGS
    return run_router_processes(argv, args.processes, config.router.metrics_port, config.router.router_id)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sluice` console script."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(raw)
    configure_logging(args.log_level, args.command, as_json=args.log_format == "json")
    try:
        return _run(args, raw)
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"sluice {args.command}: needs {exc.name}: pip install 'sluice-inference[{extra}]'",
            file=sys.stderr,
        )
        return EXIT_BAD_ARGS
    except ConfigError as exc:
        print(f"sluice: configuration error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except KeyboardInterrupt:
        return 130
