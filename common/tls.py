"""PEM files → gRPC credentials, for every TLS hop (client → router, router → worker, → etcd).

Files are read when credentials are built (at process start, or when a client reconnects), never at
import. A file that cannot be read is a `ConfigError` naming the config key that points at it, so a
typo in a mounted Secret's path fails at start with the key in the message.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from sluice_inference.common.config import ConfigError


def read_pem(path: Path, key: str) -> bytes:
    """The bytes of a PEM file; ConfigError naming `key` when unreadable or not PEM."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{key}: {path} is not a PEM file")
    return data


def read_optional_pem(path: Path | None, key: str) -> bytes | None:
    """`read_pem`, or None when the setting is unset."""
    return None if path is None else read_pem(path, key)


def server_credentials(
    *,
    cert_file: Path,
    key_file: Path,
    client_ca_file: Path | None,
    require_client_cert: bool,
    section: str,
    ca_key: str = "ca_file",
) -> grpc.ServerCredentials:
    """TLS for a gRPC server; with `client_ca_file`, client certificates are verified against it (and,
    with `require_client_cert`, required). Errors name `section.<key>` (`ca_key` for the CA file)."""
    return grpc.ssl_server_credentials(
        [(read_pem(key_file, f"{section}.key_file"), read_pem(cert_file, f"{section}.cert_file"))],
        root_certificates=read_optional_pem(client_ca_file, f"{section}.{ca_key}"),
        require_client_auth=require_client_cert,
    )


def channel_credentials(
    *, ca_file: Path | None, cert_file: Path | None, key_file: Path | None, section: str
) -> grpc.ChannelCredentials:
    """TLS for a gRPC client: the server is verified against `ca_file` (unset: the system roots); with
    `cert_file`/`key_file` the client presents a certificate (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_optional_pem(ca_file, f"{section}.ca_file"),
        private_key=read_optional_pem(key_file, f"{section}.key_file"),
        certificate_chain=read_optional_pem(cert_file, f"{section}.cert_file"),
    )
