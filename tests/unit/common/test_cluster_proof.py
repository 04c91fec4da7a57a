"""The identity proof of common/cluster_proof.py, driven directly (no sockets, a fake clock): a server's
answer proves the token and the identity; a caller's proof is good for one method, on one exchange, once,
within 30 s; nothing either side sends contains or lets anyone rebuild the token."""

from __future__ import annotations

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.cluster_proof import (
    COOKIE_TTL_S,
    Answer,
    CallerClaim,
    IdentityNotProven,
    ProofIssuer,
    caller_proof,
    check_answer,
    derive_key,
    new_nonce,
)
from sluice_inference.common.errors import Unauthenticated

TOKEN, OTHER = "cluster-token-" + "a" * 20, "cluster-token-" + "b" * 20
ME, CALLER, METHOD = "workers/w-3", "routers/r-1", "/sluice.v1.Worker/Stream"


def exchange(issuer: ProofIssuer, clock: FakeClock, token: str = TOKEN) -> tuple[bytes, Answer, CallerClaim]:
    """One challenge, answered and checked by the caller holding `token`; its claim for METHOD."""
    nonce = new_nonce()
    answer = issuer.answer(ME, CALLER, nonce, clock.now())
    key = derive_key(token)
    check_answer(key, caller=CALLER, expected=ME, caller_nonce=nonce, answer=answer)
    proof = caller_proof(
        key, caller=CALLER, identity=ME, caller_nonce=nonce, server_nonce=answer.server_nonce, method=METHOD
    )
    return nonce, answer, CallerClaim(CALLER, nonce, answer.server_nonce, proof)


def test_a_proven_exchange_authenticates_one_call_once() -> None:
    clock, issuer = FakeClock(100.0), ProofIssuer([TOKEN])
    _, answer, claim = exchange(issuer, clock)
    assert issuer.check(ME, claim, METHOD, clock.now()) == CALLER
    with pytest.raises(Unauthenticated, match="already used"):
        issuer.check(ME, claim, METHOD, clock.now())
    wire = b"".join([answer.server_nonce, *answer.token_proofs, claim.proof, claim.caller_nonce])
    assert TOKEN.encode() not in wire and derive_key(TOKEN) not in wire


def test_a_proof_names_its_method_identity_and_expires() -> None:
    clock, issuer = FakeClock(100.0), ProofIssuer([TOKEN])
    _, _, claim = exchange(issuer, clock)
    with pytest.raises(Unauthenticated, match="wrong cluster proof"):
        issuer.check(ME, claim, "/sluice.v1.WorkerAdmin/Drain", clock.now())
    with pytest.raises(Unauthenticated, match="wrong cluster proof"):
        issuer.check("workers/w-4", claim, METHOD, clock.now())
    clock.advance(COOKIE_TTL_S + 0.1)
    with pytest.raises(Unauthenticated, match="expired"):
        issuer.check(ME, claim, METHOD, clock.now())


def test_cookies_of_another_process_or_tampered_are_refused() -> None:
    clock = FakeClock(100.0)
    _, _, claim = exchange(ProofIssuer([TOKEN]), clock)
    with pytest.raises(Unauthenticated, match="not a challenge this process issued"):
        ProofIssuer([TOKEN]).check(ME, claim, METHOD, clock.now())
    issuer = ProofIssuer([TOKEN])
    _, _, claim = exchange(issuer, clock)
    forged = CallerClaim(CALLER, new_nonce(), claim.server_nonce, claim.proof)  # another caller nonce
    with pytest.raises(Unauthenticated, match="not a challenge this process issued"):
        issuer.check(ME, forged, METHOD, clock.now())
    with pytest.raises(Unauthenticated, match="no cluster proof"):
        issuer.check(ME, None, METHOD, clock.now())


def test_the_caller_checks_identity_and_token_before_answering() -> None:
    clock, issuer = FakeClock(0.0), ProofIssuer([OTHER])
    nonce = new_nonce()
    answer = issuer.answer(ME, CALLER, nonce, clock.now())
    with pytest.raises(IdentityNotProven, match="no proof under this cluster token"):
        check_answer(derive_key(TOKEN), caller=CALLER, expected=ME, caller_nonce=nonce, answer=answer)
    with pytest.raises(IdentityNotProven, match="not 'workers/w-4'"):
        check_answer(
            derive_key(OTHER), caller=CALLER, expected="workers/w-4", caller_nonce=nonce, answer=answer
        )
    with pytest.raises(IdentityNotProven, match="no token proof"):
        bare = Answer(ME, answer.server_nonce, ())
        check_answer(derive_key(OTHER), caller=CALLER, expected=ME, caller_nonce=nonce, answer=bare)
    with pytest.raises(IdentityNotProven):  # an answer to another challenge does not prove this one
        check_answer(derive_key(OTHER), caller=CALLER, expected=ME, caller_nonce=new_nonce(), answer=answer)


def test_during_a_rotation_both_tokens_prove_and_are_accepted() -> None:
    clock, issuer = FakeClock(0.0), ProofIssuer([TOKEN, OTHER])
    for token in (TOKEN, OTHER):
        _, answer, claim = exchange(issuer, clock, token)
        assert len(answer.token_proofs) == 2
        assert issuer.check(ME, claim, METHOD, clock.now()) == CALLER


def test_challenges_out_of_bounds_are_refused_before_any_work() -> None:
    issuer = ProofIssuer([TOKEN])
    for caller, nonce in (
        ("", new_nonce()),
        ("x" * 257, new_nonce()),
        (CALLER, b"short"),
        (CALLER, bytes(65)),
    ):
        with pytest.raises(Unauthenticated):
            issuer.answer(ME, caller, nonce, 0.0)
