"""A bounded close is bounded even when the close ignores its cancel (common/etcd.close_within): aetcd's
close did, and `asyncio.wait_for` then waited for it, holding a router's stop past its 5 s step."""

from __future__ import annotations

import asyncio

import pytest

from sluice_inference.common.etcd import EtcdUnavailable, close_within


async def _stubborn_close(release: asyncio.Event, cancels: list[int]) -> None:
    """A close that swallows its first cancel, as an unresponsive channel close does."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancels.append(1)


def test_a_close_that_ignores_its_cancel_is_left_behind_at_the_bound() -> None:
    async def scenario() -> tuple[bool, int]:
        release, cancels = asyncio.Event(), list[int]()
        closing = asyncio.ensure_future(
            close_within(_stubborn_close(release, cancels), 0.05, "a stubborn close")
        )
        done, _ = await asyncio.wait({closing}, timeout=2.0)  # with wait_for inside, not before `release`
        release.set()
        await closing
        return closing in done, len(cancels)

    returned_in_time, cancels = asyncio.run(scenario())
    assert cancels == 1  # it was asked to stop
    assert returned_in_time  # and not waited for


def test_an_etcd_failure_while_closing_is_swallowed_and_a_bug_is_not() -> None:
    async def failing(exc: BaseException) -> None:
        raise exc

    asyncio.run(close_within(failing(EtcdUnavailable("gone")), 1.0, "a client"))
    with pytest.raises(KeyError):
        asyncio.run(close_within(failing(KeyError("bug")), 1.0, "a client"))
