"""Where each process connects and how each hop proves itself: etcd, TLS on the router's client port,
the Redis the routers share, and the router-worker hop (docs/security.md). Every secret may come from a
file (a mounted Kubernetes Secret) and is never logged.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from sluice_inference.common.config_rules import Section, require_pair, secret_from


class EtcdSettings(Section):
    """Where the cluster registry lives."""

    endpoints: list[str] = Field(default=["127.0.0.1:2379"], min_length=1)
    """host:port of etcd members; the first reachable one is used."""
    prefix: str = "/sluice/"
    """Key prefix for workers/, routers/, tenants/."""
    lease_ttl_s: int = Field(default=10, ge=2, le=300)
    """TTL of worker and router leases; keepalive runs every TTL/3, so a frozen process vanishes after TTL."""
    tls: bool = False
    """Connect with TLS. Implied by `ca_file`; alone, etcd's certificate is verified against the system
    roots."""
    ca_file: Path | None = None
    """PEM CA bundle etcd's server certificate is verified against (turns TLS on)."""
    cert_file: Path | None = None
    """PEM client certificate, for an etcd started with `--client-cert-auth` (with `key_file`)."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    username: str | None = None
    """etcd user (etcd's `auth enable`); a token is obtained at connect and again after it expires."""
    password: SecretStr | None = None
    """Password of `username`; prefer `password_file`. Never logged."""
    password_file: Path | None = None
    """File holding the password (read once at start; a trailing newline is ignored)."""
    _password: SecretStr | None = PrivateAttr(default=None)

    @field_validator("prefix")
    @classmethod
    def _prefix_is_a_folder(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/"):
            raise ValueError("must start and end with '/'")
        return value

    @model_validator(mode="after")
    def _credentials_agree(self) -> EtcdSettings:
        require_pair(self.cert_file, self.key_file)
        self._password = secret_from(self.password, self.password_file, "password_file")
        if (self.username is None) != (self._password is None):
            raise ValueError("username and password (or password_file) go together")
        return self

    def password_value(self) -> str | None:
        """The etcd password, from `password` or `password_file`."""
        return None if self._password is None else self._password.get_secret_value()

    @property
    def uses_tls(self) -> bool:
        """Whether connections to etcd use TLS."""
        return self.tls or self.ca_file is not None or self.cert_file is not None


class ServerTlsSettings(Section):
    """TLS on the router's client port: off while `cert_file` is unset."""

    cert_file: Path | None = None
    """PEM certificate chain the router presents to clients (with `key_file`); turns TLS on."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    client_ca_file: Path | None = None
    """PEM CA bundle client certificates are verified against (mTLS). Without `require_client_cert`,
    a certificate is verified when a client presents one, and clients without one still connect."""
    require_client_cert: bool = False
    """Refuse clients that do not present a certificate signed by `client_ca_file` (mTLS). API keys
    are still required on top: a certificate says which machine calls, a key which tenant."""

    @model_validator(mode="after")
    def _complete(self) -> ServerTlsSettings:
        require_pair(self.cert_file, self.key_file)
        if self.cert_file is None and (self.client_ca_file is not None or self.require_client_cert):
            raise ValueError("client_ca_file and require_client_cert need cert_file and key_file")
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the client port speaks TLS."""
        return self.cert_file is not None


MIN_HMAC_KEY_CHARS = 32
"""Shortest accepted Redis HMAC key (`openssl rand -hex 32` gives 64 characters)."""


class RedisSettings(Section):
    """The Redis (or Valkey) shared by routers for the result cache and idempotency records."""

    url: str | None = None
    """e.g. redis://redis:6379/0, or rediss://... for TLS; unset: per-router in-process stores only (local
    mode). Put no password in it: use `password` or `password_file`."""
    prefix: str = "sluice:"
    """Prepended to every key and channel."""
    timeout_s: float = Field(default=0.2, gt=0, le=10)
    """Per call: what a hung Redis may cost a request."""
    username: str | None = None
    """ACL user (Redis 6+ `ACL SETUSER`); unset: the `default` user that `requirepass` protects."""
    password: SecretStr | None = None
    """AUTH password; prefer `password_file`. Never logged."""
    password_file: Path | None = None
    """File holding the password (read once at start; a trailing newline is ignored)."""
    ca_file: Path | None = None
    """PEM CA bundle the server certificate is verified against (rediss:// URLs only; unset: system
    roots)."""
    cert_file: Path | None = None
    """PEM client certificate, for a server started with `tls-auth-clients yes` (with `key_file`)."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    hmac_key: SecretStr | None = None
    """Key of the HMAC-SHA256 that signs every cache entry and idempotency record a router writes to
    Redis; a value that does not verify is a miss (counted in
    `sluice_router_store_integrity_failures_total`), never served or replayed. Required with `url`, the
    same on every router, at least 32 characters (e.g. `openssl rand -hex 32`). Prefer `hmac_key_file`.
    Never logged."""
    hmac_key_file: Path | None = None
    """File holding `hmac_key` (a mounted Kubernetes Secret), read once at start."""
    accepted_hmac_keys: list[SecretStr] = []
    """Keys that also verify what is read (never used to write): during a rotation, the old one
    (docs/security.md)."""
    _password: SecretStr | None = PrivateAttr(default=None)
    _hmac_key: SecretStr | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _credentials_agree(self) -> RedisSettings:
        require_pair(self.cert_file, self.key_file)
        self._password = secret_from(self.password, self.password_file, "password_file")
        files = (self.ca_file, self.cert_file)
        if any(f is not None for f in files) and not (self.url or "").startswith("rediss://"):
            raise ValueError("ca_file, cert_file and key_file need a rediss:// url")
        if self.url and "@" in self.url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("url: put credentials in username/password(_file), not in the URL")
        self._hmac_key = secret_from(self.hmac_key, self.hmac_key_file, "hmac_key_file")
        if self.url and self._hmac_key is None:
            raise ValueError(
                "redis.hmac_key (or redis.hmac_key_file) is required with redis.url: anyone who can write "
                "to Redis could otherwise plant cache entries and idempotency records"
            )
        for secret in (self._hmac_key, *self.accepted_hmac_keys):
            if secret is not None and len(secret.get_secret_value()) < MIN_HMAC_KEY_CHARS:
                raise ValueError(f"redis HMAC keys must have at least {MIN_HMAC_KEY_CHARS} characters")
        return self

    def password_value(self) -> str | None:
        """The AUTH password, from `password` or `password_file`."""
        return None if self._password is None else self._password.get_secret_value()

    def hmac_keys(self) -> list[bytes]:
        """The key that signs what this router writes, then the keys also accepted on reads (empty
        without `hmac_key`)."""
        mine = [] if self._hmac_key is None else [self._hmac_key]
        return [s.get_secret_value().encode() for s in (*mine, *self.accepted_hmac_keys)]


MIN_TOKEN_CHARS = 16


class ClusterSettings(Section):
    """The router ↔ worker hop: settings both ends must agree on, and how each end proves who it is.

    A worker runs only batches it can attribute to a router: with mTLS (`cert_file`, `key_file`,
    `ca_file`), a client certificate signed by the cluster CA naming a router; with a token, a proof of
    the token over a challenge the worker issued (the token itself is never sent). Callers send nothing
    to an address from etcd before the peer proved the identity its record claims (docs/security.md). A
    worker with neither refuses to start. Every credential configured is required.
    """

    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest message on a router ↔ worker stream, in either direction: workers accept batches up to
    it and routers cut batches (inputs and expected outputs) to fit it."""
    cert_file: Path | None = None
    """This process's certificate on the cluster hop (PEM): a worker's server certificate, or a router's
    (or the CLI's) client certificate. With `key_file` and `ca_file` it turns mTLS on."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    ca_file: Path | None = None
    """PEM bundle of the cluster CA: workers accept only client certificates it signed, routers only
    worker certificates it signed, each naming the worker id dialled (`<worker-id>.worker.sluice`, not
    the address: no `server_name` is needed for pod IPs). During a CA rotation it holds the old and the
    new CA."""
    token: SecretStr | None = None
    """Shared secret of routers, workers and operator tools. Never sent: each end proves it holds it
    with an HMAC over a fresh challenge (docs/security.md); at least 16 characters, random ones
    (`openssl rand -hex 32`) since every proof is an offline guess-check. Prefer `token_file`. Never
    logged."""
    token_file: Path | None = None
    """File holding `token` (a mounted Kubernetes Secret), read once at start."""
    accepted_tokens: list[SecretStr] = []
    """Tokens workers accept besides `token`: during a rotation, the old one (docs/security.md)."""
    _token: SecretStr | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _credentials_agree(self) -> ClusterSettings:
        tls_files = (self.cert_file, self.key_file, self.ca_file)
        if any(f is not None for f in tls_files) and not all(f is not None for f in tls_files):
            raise ValueError("mTLS needs all three of cert_file, key_file and ca_file")
        self._token = secret_from(self.token, self.token_file, "token_file")
        for secret in (self._token, *self.accepted_tokens):
            if secret is not None and len(secret.get_secret_value()) < MIN_TOKEN_CHARS:
                raise ValueError(f"cluster tokens must have at least {MIN_TOKEN_CHARS} characters")
        return self

    @property
    def tls(self) -> bool:
        """Whether the hop uses mTLS."""
        return self.ca_file is not None

    def token_value(self) -> str | None:
        """The token this process presents, from `token` or `token_file`."""
        return None if self._token is None else self._token.get_secret_value()

    def accepted(self) -> list[str]:
        """Every token a worker accepts (empty: no token check)."""
        mine = [] if self._token is None else [self._token]
        return [s.get_secret_value() for s in (*mine, *self.accepted_tokens)]
