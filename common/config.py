"""Typed configuration: one YAML file (`sluice.yaml`), then `SLUICE_*` environment variables, then flags.

Precedence is file < environment < flags. Nested keys use `__` in the environment
(`SLUICE_ROUTER__LISTEN=0.0.0.0:9001`). Validation lives in the models, so a bad value fails at start with
the offending key named (`ConfigError: router.metrics_port: Input should be ...`). Nothing here is read at
import time.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

ENV_PREFIX = "SLUICE_"


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _secret_from(value: SecretStr | None, path: Path | None, key: str) -> SecretStr | None:
    """The secret given inline (`value`) or in the file at `path`, not both; ValueError naming `key`."""
    if path is None:
        return value
    if value is not None:
        raise ValueError(f"set {key.removesuffix('_file')} or {key}, not both")
    return read_secret(path, key)


def read_secret(path: Path, key: str) -> SecretStr:
    """The secret held in a file (a mounted Kubernetes Secret), without its trailing newline; ValueError
    naming `key` when it cannot be read or is empty. The value itself never appears in a message."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc}") from None
    if not text:
        raise ValueError(f"{key}: {path} is empty")
    return SecretStr(text)


def _pair(cert_file: Path | None, key_file: Path | None) -> None:
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together: set both or neither")


_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def _check_key_hashes(value: list[str]) -> list[str]:
    bad = [k for k in value if not _KEY_HASH.match(k)]
    if bad:
        raise ValueError("each key must be 'sha256:' + 64 lowercase hex digits (see `sluice keys hash`)")
    return value


class EtcdSettings(_Section):
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
        _pair(self.cert_file, self.key_file)
        self._password = _secret_from(self.password, self.password_file, "password_file")
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


class ServerTlsSettings(_Section):
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
        _pair(self.cert_file, self.key_file)
        if self.cert_file is None and (self.client_ca_file is not None or self.require_client_cert):
            raise ValueError("client_ca_file and require_client_cert need cert_file and key_file")
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the client port speaks TLS."""
        return self.cert_file is not None


class RouterSettings(_Section):
    """The stateless front end."""

    listen: str = "0.0.0.0:8001"
    """gRPC address for clients (KServe v2, health, reflection, admin)."""
    metrics_port: int = Field(default=8002, ge=0, le=65535)
    """Prometheus /metrics port (0: pick a free one)."""
    router_id: str = ""
    """Name in etcd and logs; empty: hostname-pid."""
    batches_in_flight_per_worker: int = Field(default=0, ge=0, le=64)
    """Batches this router keeps on one worker at once; 0 (the default): by the worker's device, 1 on a CPU
    (a second batch in flight overlaps nothing there: the forward and the hop share the host's cores, so it
    only halved the batches and added a message each way: docs/performance.md, "The second sitting of
    2026-12-01"), 2 on an accelerator (the next batch's transfer overlaps the current compute). Set 2 for
    CPU workers on nodes of their own whose network round trip is a sizeable part of a forward."""
    default_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for requests that carry neither a gRPC deadline nor parameters["timeout"]."""
    max_timeout_s: float = Field(default=300.0, gt=0)
    """Longest deadline a request may have: a longer `parameters["timeout"]` or gRPC deadline is shortened
    to it (a request may only shorten the server's limit; router/policy/deadline_budget.py)."""
    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request or response message on the client port; a request whose response would be larger
    (rows x outputs x bytes) is refused before any work. Every concurrent read may hold this much."""
    max_inflight_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    """Budget for the bytes of requests being served (their bodies plus their expected responses): a
    request that would exceed it is refused with RESOURCE_EXHAUSTED and a retry hint."""
    stream_max_inflight: int = Field(default=64, ge=1, le=10_000)
    """Requests of one `ModelStreamInfer` stream served at once; the router stops reading the stream
    (backpressure) until one of them has been answered."""
    tenant_max_receives: int = Field(default=2, ge=1, le=1024)
    """`ModelInfer` bodies one tenant may have arriving at once. More calls of the tenant wait, unread, for
    up to `RECEIVE_SLOT_WAIT_S` (router/receive_gate.py), then are refused RESOURCE_EXHAUSTED with a retry
    hint: slow uploads hold at most this many bodies of `max_message_bytes` per tenant."""
    tenant_max_streams: int = Field(default=2, ge=1, le=1024)
    """`ModelStreamInfer` streams one tenant may have open at once (each may be receiving one message);
    more are refused RESOURCE_EXHAUSTED with a retry hint before anything of them is read."""
    receive_timeout_s: float = Field(default=30.0, gt=0)
    """A `ModelInfer` body must have arrived this long after the call did (waiting for a receive slot
    included); a slower one is refused DEADLINE_EXCEEDED and its bytes are let go."""
    max_concurrent_streams: int = Field(default=1024, ge=1, le=65_536)
    """HTTP/2 streams (calls) one client connection may have open at once on the client port
    (`grpc.max_concurrent_streams`); a client queues the calls beyond it once it has the router's
    settings, and a call opened beyond it before then fails UNAVAILABLE (REFUSED_STREAM). gRPC clients
    share one connection per target across channels, so keep it above a client's burst."""
    watchdog_s: float = Field(default=5.0, gt=0)
    """A decision loop that has not ticked for this long is declared stuck: what it held is failed and
    health turns NOT_SERVING, so the orchestrator restarts the router."""
    worker_hang_s: float = Field(default=5.0, gt=0)
    """A worker that holds batches and answers none for this long (or 10x the estimate of what it holds,
    if longer) is treated as dead: its requests are re-dispatched and its stream is closed."""
    door_max_delay_ms: float = Field(default=250.0, ge=0)
    """The front door (router/policy/door.py): once calls have waited longer than this before the
    router's code runs for `door_sustain_s`, part of the new inference requests are refused UNAVAILABLE
    with a retry hint before they are parsed, lowest tenant `default_priority` first, so a router whose own
    CPU is the limit keeps serving what it admits in time. Set it near the latency you promise (the peer
    benchmark uses 20 ms for a 50 ms SLO); 0 turns it off."""
    door_sustain_s: float = Field(default=1.0, ge=0)
    """How long the wait must exceed `door_max_delay_ms` before the door first refuses anything: bursts
    that drain and closed-loop clients' standing queues are served."""
    pressure_hold_factor: float = Field(default=5.0, ge=1.0, le=10.0)
    """While the router's own CPU is short, how far past a model's `batching.max_wait_ms` a lane may hold
    its oldest request for a fuller batch: the hold grows with the CPU pressure of the router's event loop,
    from none at 0.5 to this many times `max_wait_ms` at 0.9 (docs/batching.md). A saturated router's calls
    already wait for it before its code runs, as Triton's requests wait for a busy model instance past
    `max_queue_delay_microseconds`; fewer, fuller batches leave it more CPU for them (on one core shared
    with its worker, 5 held the SLO at 1,300-1,500 req/s in 8 of 12 runs, 3 in 2: docs/performance.md,
    2026-12-03). 1 keeps every hold within `max_wait_ms`; a model with `max_wait_ms: 0` is never held;
    budgets still cut."""
    batcher: Literal["adaptive", "timer"] = "adaptive"
    """`adaptive`: batch size from the latency model and arrival rate; `timer`: the classic fixed
    max_batch_size + max_wait (Triton's dynamic batcher), kept for comparison."""
    scheduler: Literal["expected_completion", "least_loaded", "round_robin"] = "expected_completion"
    """How a batch picks its worker (router/policy/scheduler.py)."""
    tls: ServerTlsSettings = ServerTlsSettings()
    """TLS (optionally mTLS) on the client port."""
    admin_keys: list[str] = []
    """SHA-256 of each admin key (`sha256:<hex>`, `sluice keys hash KEY`): keys that may call
    `sluice.v1.RouterAdmin` without being any tenant's. A tenant with `admin: true` may too. With no
    admin key, no tenant key and `admission.require_api_key` false (key-less local mode), admin is open."""

    @field_validator("admin_keys")
    @classmethod
    def _admin_keys_hashed(cls, value: list[str]) -> list[str]:
        return _check_key_hashes(value)

    @model_validator(mode="after")
    def _timeouts_agree(self) -> RouterSettings:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        return self


class WorkerSettings(_Section):
    """A process that owns one device."""

    repository: Path = Path("models")
    """Model repository root (models/<name>/config.yaml, models/<name>/<version>/...)."""
    models: list[str] = []
    """Names of models to load; empty: every model in the repository."""
    device: str = "cpu"
    """`cpu` or `cuda:N`."""
    torch_threads: int = Field(default=1, ge=1, le=256)
    """Intra-op threads for torch; 1 keeps latency steady on small shared machines."""
    listen: str = "127.0.0.1:0"
    """gRPC bind address; port 0 picks a free port, and the worker registers the one it got."""
    advertise_host: str = "127.0.0.1"
    """Host routers should dial (the pod IP in Kubernetes)."""
    worker_id: str = ""
    """Name in etcd; empty: hostname-pid."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus /metrics port (0: pick a free one)."""
    capacity: int = Field(default=4, ge=1, le=64)
    """Batches this worker holds at once (waiting or running), across all routers' streams. A batch
    arriving beyond it is answered at once, never run: every item UNAVAILABLE with reason `worker_busy`,
    not the worker's fault, for the router to place elsewhere. Published in the worker's etcd record;
    routers keep each worker's queue within it using the load on every answer. Batches waiting together
    for the same model and shape run as one forward, so what a full queue costs a new batch is about one
    merged forward plus the running one. 4: one running plus one waiting for each of up to 3 routers
    sending at once, so the device never idles between forwards while every router has its next batch
    there (docs/operations.md, "Worker capacity"; figures in docs/benchmarks.md)."""
    drain_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a drain waits for in-flight batches before exiting anyway."""
    idle_report_interval_s: float = Field(default=1.0, ge=0.25, le=5.0)
    """How often a worker with no batches reports its load to the routers (its heartbeat); every 0.25 s
    while it holds any. A router closes an idle worker's stream after this plus 0.55 s of silence, and a
    busy one's 0.8 s after its last message or batch sent (common/heartbeat.py). 0.25: never slower."""
    dev: bool = False
    """Development mode (`sluice worker --dev`): accept the cluster token that deploy/overlays/dev
    publishes (common/dev_token.py). Anywhere reachable by others, leave it off: that token is public."""
    forward_on_loop: bool = False
    """Run forwards on the worker's event loop instead of its device thread: no thread hand-off per
    forward in either direction (worker/device_thread.py), which saves CPU per batch for small models on
    a CPU shared with the router (docs/performance.md, "The hop"). A forward then holds up the worker's
    stream I/O and load reports for its whole duration, so only for models whose forwards stay far under
    the routers' 0.8 s heartbeat; never worth it on CUDA, where the thread overlaps the loop's work with
    the device's."""
    synthetic_slowdown: float = Field(default=1.0, gt=0)
    """Multiplies the simulated latency of `synthetic` models: makes this worker a slower device in
    scheduling tests and benchmarks. No effect on real models."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "cpu" and not (value.startswith("cuda:") and value[5:].isdigit()):
            raise ValueError("must be 'cpu' or 'cuda:N'")
        return value


ANONYMOUS_TENANT = "anonymous"


class TenantSettings(_Section):
    """One tenant's identity and quotas (docs/design.md §8). Priorities follow Triton: 1 is the highest."""

    api_keys: list[str] = []
    """SHA-256 of each API key, as `sha256:<hex>` (`sluice keys hash KEY` prints one); keys never stored."""
    rate: float = Field(default=100.0, gt=0)
    """Requests per second (token-bucket refill), cluster-wide: shared by the routers as demand arrives."""
    burst: int = Field(default=100, ge=1)
    """Token-bucket size: how many requests may arrive at once above the rate."""
    max_inflight: int = Field(default=64, ge=1)
    """Requests admitted and not yet answered, cluster-wide: shared by the routers as demand arrives."""
    weight: float = Field(default=1.0, gt=0)
    """Fair share within a priority level, relative to the other tenants queued there."""
    default_priority: int = Field(default=2, ge=1)
    """Priority of requests that ask for 0 (or none)."""
    max_priority: int = Field(default=2, ge=1)
    """The best priority this tenant may use; requests asking for better are capped to it. Unset, it is
    `default_priority`: a tenant is granted better than its default only explicitly (with 1 as the
    default for everyone, any tenant could send priority 1 and evict the others' queued work)."""
    models: list[str] = ["*"]
    """Models this tenant may call (glob patterns)."""
    admin: bool = False
    """The admin role: this tenant's keys may also call `sluice.v1.RouterAdmin` (list workers and
    tenants, read stats, purge the cache). Plain tenant keys get PERMISSION_DENIED there."""

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, value: list[str]) -> list[str]:
        return _check_key_hashes(value)

    @model_validator(mode="before")
    @classmethod
    def _no_grant_by_default(cls, data: object) -> object:
        if isinstance(data, dict) and "max_priority" not in data and "default_priority" in data:
            return {**data, "max_priority": data["default_priority"]}
        return data

    @model_validator(mode="after")
    def _priorities_agree(self) -> TenantSettings:
        if self.default_priority < self.max_priority:
            raise ValueError("default_priority must not be better (lower) than max_priority")
        return self


class AdmissionSettings(_Section):
    """Admission and overload control: bounds, the global quota, anti-starvation."""

    enabled: bool = True
    """False turns every check off (a plain unbounded FIFO): only for baseline comparisons."""
    global_rate: float | None = Field(default=None, gt=0)
    """Requests per second for the whole cluster, shared by the routers as demand arrives; unset: none."""
    global_burst: int = Field(default=1000, ge=1)
    """Bucket size of the global limit."""
    lane_max_queued: int = Field(default=1000, ge=1)
    """Most requests one lane (model, version, shape) may hold queued."""
    max_queued_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    """Most input bytes all lanes together may hold queued (part of `router.max_inflight_bytes`)."""
    aging_s: float = Field(default=2.0, gt=0)
    """A queued request competes one priority level higher per `aging_s` waited, so low priorities never
    starve."""
    estimate_margin: float = Field(default=1.2, ge=1.0)
    """Safety factor on learned execution-time estimates when judging whether a deadline can be met."""
    require_api_key: bool = False
    """Refuse requests without a key even when an `anonymous` tenant is configured."""
    priority_levels: int = Field(default=10, ge=1, le=1000)
    """Priority levels (1 is the highest, as in Triton): `parameters["priority"]` outside 0..levels is
    INVALID_ARGUMENT, and tenants' default and max priorities must lie within them."""
    quota_shares: Literal["demand", "equal"] = "demand"
    """How routers split cluster-wide quotas: `demand` — each router's share of a tenant's rate, burst and
    in-flight cap (and of the global rate) follows where that tenant's requests arrive, published through
    etcd; `equal` — 1/N each for N live routers (exact only when clients spread evenly)."""
    share_floor: float = Field(default=0.1, ge=0.0, le=1.0)
    """ε: no router's share falls below ε/N of a limit, so a router admits a tenant's first requests at
    once; the shares of all routers then add up to at most (1 + ε) x the limit."""
    max_routers: int = Field(default=100, ge=1, le=10_000)
    """The most routers this cluster runs. Shares count at most this many (this router included), however
    many records `routers/` holds, so records written by someone else cannot push this router's
    fraction of a limit below `share_floor / max_routers` (nor the equal split below 1 / max_routers).
    Set it to the largest router count you deploy: above it, shares are computed as if there were this
    many routers, and the routers together may admit up to (live routers / max_routers) x the limit."""
    demand_window_s: float = Field(default=0.5, gt=0.0, le=60.0)
    """Time constant of the decaying request rate each router publishes as its demand: shares follow a
    move of the load within about two of these, plus two publish intervals."""
    demand_publish_s: float = Field(default=0.25, ge=0.05, le=60.0)
    """Least time between two demand publishes of one router (stretched to N/100 s with N routers, so the
    cluster writes at most 100 records a second); a router republishes only when its demand moved by
    more than 20 %."""


MIN_HMAC_KEY_CHARS = 32
"""Shortest accepted Redis HMAC key (`openssl rand -hex 32` gives 64 characters)."""


class RedisSettings(_Section):
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
        _pair(self.cert_file, self.key_file)
        self._password = _secret_from(self.password, self.password_file, "password_file")
        files = (self.ca_file, self.cert_file)
        if any(f is not None for f in files) and not (self.url or "").startswith("rediss://"):
            raise ValueError("ca_file, cert_file and key_file need a rediss:// url")
        if self.url and "@" in self.url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("url: put credentials in username/password(_file), not in the URL")
        self._hmac_key = _secret_from(self.hmac_key, self.hmac_key_file, "hmac_key_file")
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


class CacheSettings(_Section):
    """The result cache (only for models declaring `deterministic: true` and `cache: enabled`)."""

    enabled: bool = True
    """Master switch for this router."""
    memory_bytes: int = Field(default=128 * 1024 * 1024, ge=0)
    """Tier 1: this router's in-memory LRU, bounded in bytes."""
    ttl_s: float = Field(default=3600.0, gt=0)
    """How long an entry lives (both tiers)."""
    audit_fraction: float = Field(default=0.01, ge=0, le=1)
    """Share of hits recomputed on a worker at the lowest priority and compared with the cached outputs
    (within each tenant's audit budget: `audit_rate`, `audit_burst`)."""
    audit_tolerance: float = Field(default=1e-5, ge=0)
    """Absolute floor of the audit tolerance for floating-point outputs: a difference this small always
    passes. Above it, the tolerance is relative to the output's magnitude: `audit_margin` times the
    model version's measured batch-vs-single deviation (docs/caching.md, "Audits")."""
    audit_margin: float = Field(default=8.0, ge=1, le=1000)
    """How many times the model version's measured relative batch-vs-single deviation (at least the output
    dtype's epsilon) a cached output may differ from a fresh run, relative to the output's largest
    magnitude. Float kernels round differently for different batch sizes (the demo MLP: up to ~9 epsilon),
    and the batch an entry came from is unknown, hence the margin."""
    audit_rate: float = Field(default=0.5, gt=0, le=1000)
    """Audits per second each tenant's hits may cause on this router (a token bucket): an audit is one or
    two executions on a worker that the tenant's rate limit does not pay for."""
    audit_burst: int = Field(default=2, ge=1, le=1000)
    """Bucket size of `audit_rate`."""
    audit_max_inflight: int = Field(default=4, ge=1, le=1000)
    """Audits running at once on this router, all tenants together; sampled hits beyond it go unaudited."""
    audit_strikes: int = Field(default=3, ge=1, le=1000)
    """Audit mismatches of one tenant's hits for one model (within `audit_ban_s`) after which that
    tenant's requests to that model bypass the cache on this router."""
    audit_ban_s: float = Field(default=3600.0, gt=0)
    """How long such a bypass lasts, and how long a mismatch counts towards it."""


class IdempotencySettings(_Section):
    """Idempotency-key records."""

    ttl_s: float = Field(default=86_400.0, gt=0)
    """How long a completed call is replayed."""
    max_records: int = Field(default=100_000, ge=1)
    """Bound on in-process records (Redis evicts by TTL)."""
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Bound on the bytes of in-process records (stored responses included); when full, the tenant holding
    the most loses its oldest record first, so each active tenant keeps a fair share."""


class AutoscaleSettings(_Section):
    """The `desired_workers` signal (router/policy/autoscale.py has the math)."""

    target_utilization: float = Field(default=0.7, gt=0, le=1)
    """Busy fraction each worker should run at; the rest absorbs bursts."""
    slo_attainment: float = Field(default=0.99, gt=0, le=1)
    """Below this share of requests answered OK within deadline, ask for one more worker."""
    scale_down_window_s: float = Field(default=120.0, ge=0)
    """A lower target must hold this long before it is exported (scale-up is immediate)."""
    min_workers: int = Field(default=1, ge=0)
    """Floor while a model has traffic."""
    max_workers: int = Field(default=1000, ge=1)
    """Ceiling."""


MIN_TOKEN_CHARS = 16


class ClusterSettings(_Section):
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
        self._token = _secret_from(self.token, self.token_file, "token_file")
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


class SluiceConfig(_Section):
    """The whole `sluice.yaml`."""

    etcd: EtcdSettings = EtcdSettings()
    router: RouterSettings = RouterSettings()
    worker: WorkerSettings = WorkerSettings()
    cluster: ClusterSettings = ClusterSettings()
    admission: AdmissionSettings = AdmissionSettings()
    redis: RedisSettings = RedisSettings()
    cache: CacheSettings = CacheSettings()
    idempotency: IdempotencySettings = IdempotencySettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    tenants: dict[str, TenantSettings] = {
        ANONYMOUS_TENANT: TenantSettings(rate=1e9, burst=1_000_000, max_inflight=1_000_000)
    }
    """Tenants by name. The default serves key-less requests (local mode) with no practical quota;
    configuring `tenants:` replaces it, so production configs list exactly who may call."""

    @model_validator(mode="after")
    def _limits_agree(self) -> SluiceConfig:
        levels = self.admission.priority_levels
        for name, tenant in self.tenants.items():
            if tenant.default_priority > levels:
                raise ValueError(
                    f"tenants.{name}.default_priority {tenant.default_priority} is outside "
                    f"admission.priority_levels ({levels})"
                )
        if self.cluster.max_message_bytes < self.router.max_message_bytes:
            raise ValueError(
                "cluster.max_message_bytes must be at least router.max_message_bytes: every request that "
                "a client may send must fit into a batch to a worker"
            )
        return self


ROUTER_BASELINE_BYTES = 128 * 1024 * 1024
"""A router's resident memory with nothing in flight (measured ≈ 70 MB: Python, gRPC, numpy, protobuf)."""


def concurrent_receives(config: SluiceConfig) -> int:
    """Request bodies a router may be receiving at once, before their size is charged to the in-flight
    budget: each configured tenant's `ModelInfer` receive slots and open streams (one message arriving
    each). Calls without a valid key are refused unread, and etcd overrides never add tenants, so the
    configured tenants are all there can be (docs/security.md, "The router's memory adds up")."""
    router = config.router
    return len(config.tenants) * (router.tenant_max_receives + router.tenant_max_streams)


def router_memory_bound(config: SluiceConfig) -> dict[str, int]:
    """The documented upper bound of a router's memory, by component (bytes). Queued inputs are part of
    the in-flight budget; the idempotency table counts only when records are kept in-process (no Redis)."""
    return {
        "baseline": ROUTER_BASELINE_BYTES,
        "in-flight requests": config.router.max_inflight_bytes,
        "receives": concurrent_receives(config) * config.router.max_message_bytes,
        "result cache": config.cache.memory_bytes if config.cache.enabled else 0,
        "idempotency records": 0 if config.redis.url else config.idempotency.max_bytes,
    }


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _env_value(raw: str) -> Any:
    """Lists and objects come as JSON (`SLUICE_ETCD__ENDPOINTS='["a:1","b:2"]'`); the rest stays a string."""
    return json.loads(raw) if raw[:1] in "[{" else raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested overrides from `SLUICE_SECTION__KEY=value` variables."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(raw)
    return tree


def _format_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"{key}: {item['msg']}")
    return "; ".join(lines)


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SluiceConfig:
    """Read the YAML file (if any), apply environment then flag overrides, and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    data = _deep_merge(data, env_overrides(os.environ if environ is None else environ))
    data = _deep_merge(data, overrides or {})
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
