"""The coalescer (router/stores/coalescer.py): concurrent identical cache misses run once, share the
result or the exception, survive one caller's cancellation, and are cancelled when every caller left."""

from __future__ import annotations

import asyncio

from sluice_inference.router.stores.coalescer import Coalescer


async def test_coalescer_runs_the_factory_once_for_concurrent_callers() -> None:
    coalescer: Coalescer[str] = Coalescer()
    calls = 0
    release = asyncio.Event()

    async def execute() -> str:
        nonlocal calls
        calls += 1
        await release.wait()
        return "result"

    callers = [asyncio.create_task(coalescer.run("k", execute)) for _ in range(20)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*callers) == ["result"] * 20
    assert calls == 1 and coalescer.stats.coalesced == 19 and coalescer.in_flight() == 0


async def test_coalescer_shares_exceptions_and_forgets_finished_runs() -> None:
    coalescer: Coalescer[str] = Coalescer()

    async def fail() -> str:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    results = await asyncio.gather(*(coalescer.run("k", fail) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)

    async def succeed() -> str:
        return "fresh"

    assert await coalescer.run("k", succeed) == "fresh"


async def test_cancelling_one_caller_does_not_cancel_the_shared_run() -> None:
    coalescer: Coalescer[str] = Coalescer()
    release = asyncio.Event()

    async def execute() -> str:
        await release.wait()
        return "result"

    callers = [asyncio.create_task(coalescer.run("k", execute)) for _ in range(3)]
    await asyncio.sleep(0)
    callers[0].cancel()
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*callers[1:]) == ["result"] * 2
    assert callers[0].cancelled()


async def test_when_every_caller_leaves_the_run_is_cancelled_and_the_key_freed() -> None:
    coalescer: Coalescer[str] = Coalescer()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def execute() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "unreachable"

    callers = [asyncio.create_task(coalescer.run("k", execute)) for _ in range(2)]
    await started.wait()
    for caller in callers:
        caller.cancel()
    await asyncio.wait_for(cancelled.wait(), 1)
    assert coalescer.in_flight() == 0 and coalescer.stats.abandoned == 1

    async def again() -> str:
        return "again"

    assert await coalescer.run("k", again) == "again"
