"""Proving possession of the cluster token without sending it (docs/design.md §9, 2026-12-01; docs/security.md
"Router → worker"). Sans-IO: bytes and `now` in, bytes or a refusal out; the gRPC ends live in
common/cluster_auth.py.

An etcd record is a claim. Before a caller sends anything secret to the address a record names, the
server there proves it holds the token *and* is the identity the record claims; then the caller proves
the same to the server, for one call. Once per connection (a router's stream) or per admin call:

1. caller → server, `ClusterIdentity/Challenge`: who is asking (`caller`), and a fresh random
   `caller_nonce` (32 bytes). Nothing derived from the token.
2. server → caller: its `identity` (`workers/<id>`, `routers/<id>`), its own `server_nonce` (a
   stateless cookie: random bytes, an expiry, a tag under a per-process secret), and one
   `HMAC(K, server transcript)` per token it accepts (two during a rotation). The caller checks the
   identity is the one the record claimed and that one proof matches its own key; otherwise it stops.
3. caller → server, the real call, with the caller proof `HMAC(K, caller transcript)` in its metadata.
   The server checks its cookie (its tag, not expired, never used before) and the proof against every
   accepted key, all before the request is read.

Transcripts are length-prefixed fields after a domain tag and a direction label (`server`, `caller`):
both identities, both nonces, and for the caller the method, so a proof is good for one direction, one
pair of parties, one connection and one method, once. A fake endpoint learns nothing it can replay: it
gets only the caller's nonce; relaying to a real server still ends at a cookie it cannot reuse.
K = scrypt(token): every proof an endpoint hands out is an offline guess-check of the token, and scrypt
makes each guess cost ~16 MiB and tens of milliseconds (long random tokens, as `sluice up` and
`openssl rand -hex 32` make, are out of reach anyway).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from sluice_inference.common.errors import ResourceExhausted, Unauthenticated

DOMAIN = b"sluice cluster proof v1\x00"
NONCE_BYTES = 32
MIN_NONCE_BYTES, MAX_NONCE_BYTES = 16, 64
MAX_NAME_CHARS = 256
"""Longest `caller` or identity accepted (both travel in metadata and transcripts)."""
COOKIE_TTL_S = 30.0
"""How long a server's nonce stays good for the caller's answer (one round trip, with ample slack)."""
MAX_USED_COOKIES = 65_536
"""Cookies remembered as spent until they expire; only authenticated callers can add to the set."""
_TAG_BYTES = 16
_RANDOM_BYTES = 16
_COOKIE_BYTES = _RANDOM_BYTES + 8 + _TAG_BYTES


@functools.lru_cache(maxsize=16)
def derive_key(token: str) -> bytes:
    """The HMAC key of a token: scrypt (n=2^14, r=8), computed once per token and process."""
    return hashlib.scrypt(token.encode(), salt=DOMAIN, n=2**14, r=8, p=1, dklen=32)


def _transcript(label: bytes, *fields: str | bytes) -> bytes:
    out = bytearray(DOMAIN)
    for field in (label, *fields):
        data = field.encode() if isinstance(field, str) else field
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def server_transcript(caller: str, identity: str, caller_nonce: bytes, server_nonce: bytes) -> bytes:
    """What a server proves (with the token, or with its certificate's key): it is `identity`, answering
    `caller`'s challenge `caller_nonce`, with its own `server_nonce`."""
    return _transcript(b"server", caller, identity, caller_nonce, server_nonce)


def caller_transcript(
    caller: str, identity: str, caller_nonce: bytes, server_nonce: bytes, method: str
) -> bytes:
    """What a caller proves with the token: it is `caller`, calling `method` on `identity`, on the
    exchange of these two nonces."""
    return _transcript(b"caller", caller, identity, caller_nonce, server_nonce, method)


def mac(key: bytes, transcript: bytes) -> bytes:
    """HMAC-SHA256 of a transcript."""
    return hmac.new(key, transcript, hashlib.sha256).digest()


def new_nonce() -> bytes:
    """A caller's fresh challenge."""
    return secrets.token_bytes(NONCE_BYTES)


class IdentityNotProven(Exception):
    """The peer at an address did not prove the identity its record claims: send it nothing."""


@dataclass(frozen=True)
class Answer:
    """A server's answer to one challenge (step 2)."""

    identity: str
    server_nonce: bytes
    token_proofs: tuple[bytes, ...]


def check_answer(key: bytes, *, caller: str, expected: str, caller_nonce: bytes, answer: Answer) -> None:
    """Caller side of step 2: IdentityNotProven unless `answer` names `expected` and carries a proof
    under `key` over this exchange."""
    if answer.identity != expected:
        raise IdentityNotProven(f"it answers as {answer.identity[:MAX_NAME_CHARS]!r}, not {expected!r}")
    if not answer.server_nonce or len(answer.server_nonce) > MAX_NONCE_BYTES:
        raise IdentityNotProven("its challenge answer has no usable nonce")
    wanted = mac(key, server_transcript(caller, expected, caller_nonce, answer.server_nonce))
    matched = False
    for proof in answer.token_proofs[:4]:
        matched |= hmac.compare_digest(proof, wanted)
    if not matched:
        reason = "no token proof" if not answer.token_proofs else "no proof under this cluster token"
        raise IdentityNotProven(f"{reason} (a different cluster, or not a member of this one)")


def caller_proof(
    key: bytes, *, caller: str, identity: str, caller_nonce: bytes, server_nonce: bytes, method: str
) -> bytes:
    """Caller side of step 3: the proof that goes with the call."""
    return mac(key, caller_transcript(caller, identity, caller_nonce, server_nonce, method))


@dataclass(frozen=True)
class CallerClaim:
    """What a caller presents with a call (step 3), read from its metadata."""

    caller: str
    caller_nonce: bytes
    server_nonce: bytes
    proof: bytes


class ProofIssuer:
    """The server's side: answers challenges and checks the callers' proofs. Holds the keys of every
    accepted token, a per-process secret for its cookies, and the cookies already spent (until they
    expire). Time is `now` on the owner's monotonic clock, passed to every call."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._keys = [derive_key(t) for t in tokens]
        self._secret = secrets.token_bytes(32)
        self._spent: dict[bytes, float] = {}

    @property
    def enabled(self) -> bool:
        """Whether any token is configured (else there is nothing to prove or check)."""
        return bool(self._keys)

    def answer(self, identity: str, caller: str, caller_nonce: bytes, now: float) -> Answer:
        """Step 2, as `identity`. Unauthenticated for a challenge out of bounds (nothing is computed)."""
        _check_bounds(caller, caller_nonce)
        random = secrets.token_bytes(_RANDOM_BYTES)
        expiry = int((now + COOKIE_TTL_S) * 1000).to_bytes(8, "big", signed=True)
        cookie = random + expiry + self._tag(random + expiry, caller, caller_nonce)
        transcript = server_transcript(caller, identity, caller_nonce, cookie)
        return Answer(identity, cookie, tuple(mac(key, transcript) for key in self._keys))

    def check(self, identity: str, claim: CallerClaim | None, method: str, now: float) -> str:
        """Step 3, for a call of `method` on `identity`: return the authenticated caller's name, or raise
        Unauthenticated (with a reason)."""
        if claim is None:
            raise Unauthenticated(
                "this worker serves only routers of its cluster: no cluster proof "
                "(ClusterIdentity/Challenge first; docs/security.md)",
                reason="missing_cluster_proof",
            )
        _check_bounds(claim.caller, claim.caller_nonce)
        cookie = claim.server_nonce
        if len(cookie) != _COOKIE_BYTES:
            raise Unauthenticated("malformed cluster challenge", reason="bad_cluster_proof")
        head, tag = cookie[:-_TAG_BYTES], cookie[-_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(head, claim.caller, claim.caller_nonce)):
            raise Unauthenticated("not a challenge this process issued", reason="bad_cluster_proof")
        expiry = int.from_bytes(head[_RANDOM_BYTES:], "big", signed=True) / 1000
        if expiry <= now or cookie in self._spent:
            raise Unauthenticated("cluster challenge expired or already used", reason="stale_cluster_proof")
        transcript = caller_transcript(claim.caller, identity, claim.caller_nonce, cookie, method)
        wanted = [mac(key, transcript) for key in self._keys]
        matched = False
        for candidate in wanted:
            matched |= hmac.compare_digest(candidate, claim.proof)
        if not matched:
            raise Unauthenticated("wrong cluster proof", reason="bad_cluster_proof")
        self._spend(cookie, expiry, now)
        return claim.caller

    def _tag(self, head: bytes, caller: str, caller_nonce: bytes) -> bytes:
        return mac(self._secret, _transcript(b"cookie", head, caller, caller_nonce))[:_TAG_BYTES]

    def _spend(self, cookie: bytes, expiry: float, now: float) -> None:
        if len(self._spent) >= MAX_USED_COOKIES:
            self._spent = {c: t for c, t in self._spent.items() if t > now}
            if len(self._spent) >= MAX_USED_COOKIES:  # forgetting one would allow its replay
                raise ResourceExhausted(
                    "too many cluster proofs in 30 s", reason="cluster_proofs", retry_after_s=1.0
                )
        self._spent[cookie] = expiry


def _check_bounds(caller: str, caller_nonce: bytes) -> None:
    if not caller or len(caller) > MAX_NAME_CHARS:
        raise Unauthenticated("cluster caller name missing or too long", reason="bad_cluster_proof")
    if not MIN_NONCE_BYTES <= len(caller_nonce) <= MAX_NONCE_BYTES:
        raise Unauthenticated(
            f"cluster challenge nonce must have {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES} bytes",
            reason="bad_cluster_proof",
        )
