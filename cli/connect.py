"""How CLI commands reach a router or worker: TLS flags, the API key, and the cluster credentials.

Router commands (`health`, `infer`, `top`, `tenants`, `workers --addr`, `cache`) take `--tls`, `--ca`,
`--cert`/`--key` (mTLS) and `--api-key` (else the `SLUICE_API_KEY` environment variable), sent as
`authorization: Bearer <key>`. `sluice drain` talks to a worker with the cluster credentials of the
config (`cluster.token` or the cluster client certificate), like a router does.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from sluice_inference.common.client import DEFAULT_CHANNEL_OPTIONS
from sluice_inference.common.tls import read_optional_pem

API_KEY_ENV = "SLUICE_API_KEY"


def add_connection_flags(parser: argparse.ArgumentParser, *, api_key: bool = True) -> None:
    """--tls, --ca, --cert, --key (and --api-key) on a command that dials a router or worker."""
    parser.add_argument("--tls", action="store_true", help="connect with TLS (implied by --ca/--cert)")
    parser.add_argument("--ca", type=Path, help="PEM CA bundle to verify the server (default: system roots)")
    parser.add_argument("--cert", type=Path, help="PEM client certificate, for servers that require mTLS")
    parser.add_argument("--key", type=Path, help="PEM private key of --cert")
    if api_key:
        parser.add_argument(
            "--api-key", help=f"API key sent as 'authorization: Bearer' (default: ${API_KEY_ENV})"
        )


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not (args.tls or args.ca or args.cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_optional_pem(args.ca, "--ca"),
        private_key=read_optional_pem(args.key, "--key"),
        certificate_chain=read_optional_pem(args.cert, "--cert"),
    )


def channel(args: argparse.Namespace, addr: str) -> grpc.Channel:
    """A blocking channel to `addr` as the flags say."""
    credentials = _credentials(args)
    if credentials is None:
        return grpc.insecure_channel(addr, options=DEFAULT_CHANNEL_OPTIONS)
    return grpc.secure_channel(addr, credentials, options=DEFAULT_CHANNEL_OPTIONS)


def aio_channel(args: argparse.Namespace, addr: str) -> grpc.aio.Channel:
    """An asyncio channel to `addr` as the flags say."""
    credentials = _credentials(args)
    if credentials is None:
        return grpc.aio.insecure_channel(addr, options=DEFAULT_CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(addr, credentials, options=DEFAULT_CHANNEL_OPTIONS)


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The API key as call metadata (empty without one)."""
    key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV)
    return () if not key else (("authorization", f"Bearer {key}"),)
