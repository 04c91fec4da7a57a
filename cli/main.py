"""`sluice`: argument parsing and dispatch. Each subcommand's work lives in its own module.

Exit codes follow grpc_health_probe for every subcommand: 0 success, 1 bad arguments, 2 connection
failure, 3 RPC failure, 4 not SERVING (health only). The global flags (`--config`, `--log-level`,
`--log-format`) go before or after the subcommand; given in both places, the one after wins
(cli/parsing.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from sluice_inference.cli.admin_cmds import add_admin_parsers, run_admin
from sluice_inference.cli.bench_cmd import add_bench_parser, run_bench
from sluice_inference.cli.connect import add_connection_flags
from sluice_inference.cli.parsing import (
    EXIT_BAD_ARGS,
    FROM_CONFIG,
    FROM_FLAGS,
    FROM_FLAGS_AND_KEY,
    Parser,
    SubcommandParser,
    about,
    add_command,
    add_etcd_flags,
    add_global_flags,
    subcommands,
)
from sluice_inference.cli.sim_cmd import add_sim_parser, run_sim
from sluice_inference.common.config import ConfigError, SluiceConfig, load_config
from sluice_inference.common.event_loop import run_server
from sluice_inference.common.logs import configure_logging

# What a slim install (client, CLI, router) leaves out, and the extra that brings it: `sluice worker` and
# `sluice models init` need torch.
_EXTRAS = {"torch": "worker", "onnx": "onnx", "onnxruntime": "onnx"}
_Parser = Parser  # the name tests/integration/test_loadgen.py builds a parser with


def _add_up(sub: argparse._SubParsersAction[SubcommandParser]) -> None:
    up = add_command(
        sub,
        "up",
        "Run a local cluster (etcd, a router, workers) until Ctrl-C stops it all.",
        "Settings: flags; --config sluice.yaml and SLUICE_* environment variables reach the router and "
        "workers it starts.",
        "Once up it prints where everything listens and the exact commands that add a router or a worker.",
    )
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
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="where the router listens (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
        "network, and without a --config that gives tenants api_keys anyone may call it, admin included)",
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


def _add_process_commands(sub: argparse._SubParsersAction[SubcommandParser]) -> None:
    """The long-running processes: up, router, worker."""
    _add_up(sub)
    router = add_command(
        sub,
        "router",
        "Run a router, the KServe v2 gRPC front end that batches requests for workers.",
        FROM_CONFIG.format(example="SLUICE_ROUTER__LISTEN"),
        "It finds workers in etcd; the router-to-worker hop needs the cluster's token or certificates "
        "(cluster.token_file, e.g. SLUICE_CLUSTER__TOKEN_FILE; docs/security.md).",
    )
    router.add_argument("--listen", help="gRPC bind address (default 0.0.0.0:8001)")
    router.add_argument("--metrics-port", type=int, help="/metrics port (default 8002; 0 picks one)")
    router.add_argument("--router-id", help="name in etcd (default hostname-pid-port)")
    router.add_argument(
        "--processes",
        type=int,
        default=1,
        help="serve the port from N router processes, one core each (SO_REUSEPORT; default 1)",
    )
    add_etcd_flags(router)

    worker = add_command(
        sub,
        "worker",
        "Run a worker: serve the repository's models on one device to routers.",
        FROM_CONFIG.format(example="SLUICE_WORKER__DEVICE"),
        "It registers in etcd; it refuses to start without the cluster's token or certificates "
        "(cluster.token_file, e.g. SLUICE_CLUSTER__TOKEN_FILE; docs/security.md).",
    )
    worker.add_argument("--repository", type=Path, help="model repository root (default models/)")
    worker.add_argument("--models", help="comma-separated model names to load (default: all)")
    worker.add_argument("--device", help="cpu or cuda:N (default cpu)")
    worker.add_argument("--torch-threads", type=int, help="torch intra-op threads (default 1)")
    worker.add_argument("--listen", help="gRPC bind address (default 127.0.0.1:0, a free port)")
    worker.add_argument("--advertise-host", help="host routers dial (default 127.0.0.1)")
    worker.add_argument("--metrics-port", type=int, help="/metrics port (default 0: pick one)")
    worker.add_argument("--worker-id", help="name in etcd (default hostname-pid)")
    worker.add_argument(
        "--dev",
        action="store_true",
        default=None,
        help="development mode: accept the public token of deploy/overlays/dev (never in production)",
    )
    add_etcd_flags(worker)


def _add_client_commands(sub: argparse._SubParsersAction[SubcommandParser]) -> None:
    """Commands that talk to a running cluster: health, infer, workers, drain."""
    health = add_command(
        sub,
        "health",
        "Probe a router or worker (grpc.health.v1), exiting as grpc_health_probe does.",
        FROM_FLAGS,
        "Exit 0 SERVING, 1 bad arguments, 2 no connection (or TLS handshake failed), 3 RPC failed, "
        "4 not SERVING: usable as a Kubernetes probe.",
    )
    health.add_argument("addr", help="HOST:PORT of a router or worker")
    health.add_argument("--service", default="", help="service name (default '': the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    add_connection_flags(health, api_key=False)

    infer = add_command(
        sub,
        "infer",
        "Send one request with random inputs to a router and print the result.",
        FROM_FLAGS_AND_KEY,
    )
    infer.add_argument("--model", required=True, help="model name")
    infer.add_argument("--version", default="", help="model version (default: latest ready)")
    infer.add_argument("--addr", default="localhost:8001", help="router HOST:PORT (default localhost:8001)")
    infer.add_argument("--random", action="store_true", help="fill every input with random values")
    infer.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    infer.add_argument("--length", type=int, default=8, help="size used for variable dims (default 8)")
    infer.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds (default 10)")
    add_connection_flags(infer)

    workers = add_command(
        sub,
        "workers",
        "List the workers registered in etcd, or with --addr as one router sees them.",
        FROM_CONFIG.format(example="SLUICE_ETCD__ENDPOINTS"),
        "Only etcd's address is read (default 127.0.0.1:2379); --addr takes an admin API key from "
        "--api-key, else $SLUICE_API_KEY, unless the router is in key-less local mode.",
    )
    workers.add_argument("--json", action="store_true", help="print the raw records as JSON")
    workers.add_argument(
        "--addr", help="ask this router instead of etcd: adds backlog, utilisation and learned estimates"
    )
    add_etcd_flags(workers)
    add_connection_flags(workers)

    drain = add_command(
        sub,
        "drain",
        "Drain a worker: it finishes in-flight work, deregisters from etcd and exits.",
        FROM_CONFIG.format(example="SLUICE_CLUSTER__TOKEN_FILE"),
        "It presents the config's cluster token (cluster.token_file; `sluice up` prints its file) or "
        "client certificate; without it the worker answers UNAUTHENTICATED.",
    )
    drain.add_argument("worker_id", metavar="WORKER", help="worker id as `sluice workers` shows it")
    drain.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the drain to finish")
    add_etcd_flags(drain)


def _add_tool_commands(sub: argparse._SubParsersAction[SubcommandParser]) -> None:
    """Offline tools: keys, certs, models; then bench, sim and the admin commands."""
    keys = add_command(sub, "keys", "API key tools: `sluice keys hash KEY`.", FROM_FLAGS)
    hash_key = add_command(
        subcommands(keys, "keys_command"),
        "hash",
        "Print the sha256:<hex> form of an API key (for api_keys and admin_keys).",
        "Settings: none: the key is the argument ('-' reads it from stdin, out of shell history).",
    )
    hash_key.add_argument("key", help="the API key (keep it out of shell history: pass '-' to read stdin)")

    certs = add_command(sub, "certs", "TLS certificate tools: `sluice certs dev DIR`.", FROM_FLAGS)
    dev = add_command(
        subcommands(certs, "certs_command"),
        "dev",
        "Write a development CA and certificates for every role (not for production).",
        FROM_FLAGS,
    )
    dev.add_argument("directory", type=Path, metavar="DIR", help="where to write them (created if missing)")
    dev.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ID",
        help="also issue the certificate of worker ID (DIR/workers/ID.pem, naming ID.worker.sluice); "
        "with a CA already in DIR, only that (repeatable)",
    )

    models = add_command(
        sub, "models", "Model repository tools: `sluice models init`, `sluice models check DIR`.", FROM_FLAGS
    )
    models_sub = subcommands(models, "models_command")
    init = add_command(
        models_sub,
        "init",
        "Write the demo models (mlp, mlp_onnx, encoder, synthetic) with fixed seeds.",
        FROM_FLAGS,
    )
    init.add_argument("--repository", type=Path, default=Path("models"), help="where (default models/)")
    init.add_argument(
        "--gpu",
        action="store_true",
        help="instead: the transformer-sized encoder (BERT-base shape, random weights) `bert`, and "
        "`bert_fp16`/`bert_bf16` for CUDA workers only; ~1.3 GB, use a folder of its own",
    )
    check = add_command(
        models_sub,
        "check",
        "Validate a model repository offline; print how each model will be served.",
        FROM_FLAGS,
        "Reads config.yaml and Triton config.pbtxt as a worker does, then loads each artifact on the CPU; "
        "exit 1 on any problem.",
    )
    check.add_argument("repository", type=Path, metavar="DIR", help="the model repository")
    check.add_argument(
        "--no-load", action="store_true", help="check configs and layout only, without loading artifacts"
    )
    add_bench_parser(sub)
    add_sim_parser(sub)
    add_admin_parsers(sub)


def _build_parser() -> argparse.ArgumentParser:
    """The whole `sluice` command line."""
    parser = Parser(
        prog="sluice",
        description=about(
            "Sluice: an inference-serving cluster of routers, workers and etcd (KServe v2).",
            FROM_CONFIG.format(example="SLUICE_ETCD__ENDPOINTS"),
            "The global options work before or after the subcommand; given in both places, the one after "
            "it wins. `sluice COMMAND --help` says what each command does.",
        ),
    )
    add_global_flags(parser, with_defaults=True)
    sub = subcommands(parser, "command")
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
                     "advertise_host", "worker_id", "dev"):  # fmt: skip
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
    from sluice_inference.cli import commands

    if args.command == "models" and args.models_command == "check":
        from sluice_inference.cli.models_check import check_repository

        return check_repository(args.repository, load=not args.no_load)
    if args.command == "models":
        return commands.models_init(args.repository, gpu=args.gpu)
    if args.command == "keys":
        return commands.hash_key(sys.stdin.readline().strip() if args.key == "-" else args.key)
    if args.command == "health":
        return commands.health(args)
    if args.command == "certs":
        return commands.certs_dev(args.directory, tuple(args.worker))
    if args.command == "infer":
        return commands.infer(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "sim":
        return run_sim(args)
    if args.command == "up":
        from sluice_inference.cli.cluster import run_local_cluster

        return run_local_cluster(args)
    return None


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from sluice_inference.cli import commands

    offline = _run_offline(args)
    if offline is not None:
        return offline
    config = _config(args)
    if args.command == "router" and args.processes != 1:
        return _router_processes(args, argv, config)
    if args.command in ("router", "worker"):
        return _serve(args.command, config)
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
    from sluice_inference.cli.router_processes import run_router_processes

    if args.processes < 1:
        print("sluice router: --processes must be at least 1", file=sys.stderr)
        return EXIT_BAD_ARGS
    if config.router.listen.rsplit(":", 1)[-1] == "0":
        print("sluice router: --processes needs a fixed listen port (not :0)", file=sys.stderr)
        return EXIT_BAD_ARGS
    return run_router_processes(argv, args.processes, config.router.metrics_port, config.router.router_id)


def _serve(command: str, config: SluiceConfig) -> int:
    """Run a router or a worker until it stops. What stops it at start is one line, not a traceback: an
    address it cannot listen on (exit 1, as a configuration error), or etcd not answering (exit 2, as
    the CLI's other commands that cannot connect)."""
    from sluice_inference.cli.commands import EXIT_CONNECTION
    from sluice_inference.common.etcd import EtcdUnavailable
    from sluice_inference.common.grpc_server import BindError

    if command == "router":
        from sluice_inference.router.main import serve_router as serve
    else:
        from sluice_inference.worker.main import serve_worker as serve
    try:
        run_server(serve(config))
    except BindError as exc:
        print(f"sluice {command}: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except EtcdUnavailable as exc:
        print(f"sluice {command}: cannot register in etcd: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    return 0


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
