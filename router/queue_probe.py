"""How long a call waits before the router's code runs: the signal of the front door (router/policy/door.py).

The router calls its own server: an empty `ModelInfer` every `PROBE_EVERY_S` over a Unix socket the same
server listens on (in a private 0700 folder of the router's user, made when the server binds it and removed
at stop: a router built and never started leaves nothing behind). gRPC queues calls per
registered method (`ModelInfer` is one: router/edge.py, `QUEUED_APART`), so only a `ModelInfer` waits in
the very queue client inference calls wait in (a health check, in another queue, came back in a
millisecond while they waited two seconds). The call carries a
per-process token in its metadata; the door's handler answers it at once, before the door and the parse.
Each probe gives the door its round trip as one sample. While a probe is out, its age is a fresh lower bound
of the delay: each time that age passes the door's bound, then twice it, four times it and so on, it is a
sample too. A queue that suddenly grows is thus seen within the bound, not when the probe finally returns,
and a long wait counts a few times (its doublings), never once per timer tick: reacting to the same stale
round trip every few milliseconds drove the door to its floor and kept 80 % of the load out where 30 % was
the excess.

Idle means idle: the delay only matters to calls that arrive, so while the door is fully open a probe is
sent only after a client `ModelInfer` has come in since the last one (`arrived`, called by the door's
handler); while it is closing or reopening, probes go on every `PROBE_EVERY_S` whatever the traffic, so it
reopens on time. Probe only as often as the purpose needs: while the door is open and the last sample was
under half its bound, the next probe waits `CALM_EVERY_S` — the door acts only on a delay sustained for
`door_sustain_s` (1 s by default), and a queue that starts growing is still seen within the bound of the
next probe's start (its age marks) — and every `PROBE_EVERY_S` once a sample comes close to the bound.
An outstanding probe is looked at exactly when its age reaches its next mark (one timer, not a poll), and
with the door off (`router.door_max_delay_ms: 0`) nothing is probed at all. Cost under traffic: 4 tiny
calls a second while calm, up to 20 near or past the bound; with none, nothing (it was 20 calls and 200
timer wake-ups a second whatever the traffic).

Calls on the socket pass the same authentication as on the client port (common/grpc_gate.py): with tenant
keys required, the probe is answered UNAUTHENTICATED, after the same wait, which is all it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
from pathlib import Path

import grpc

from sluice_inference.common.clock import Clock, Timer, wait_until
from sluice_inference.router.edge import PROBE_KEY
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.door import Door

PROBE_EVERY_S = 0.05
"""Between probes while the door is closing or reopening, or a sample came close to its bound."""
CALM_EVERY_S = 0.25
"""Between probes while the door is open and the last sample was under half its bound."""
INFER = "/inference.GRPCInferenceService/ModelInfer"
STOP_WAIT_S = 1.0
"""How long `stop` waits for a cancelled probe call to wind down."""
PROBE_TIMEOUT_S = 10.0
"""A probe never waits longer; its age already tells the door everything past the bound."""


def pause_after(door: Door) -> float:
    """How long after a probe's sample the next probe may go (module docstring); bench/door_model.py
    paces its modelled probe by the same rule."""
    calm = not door.engaged and door.delay_s < door.max_delay_s / 2
    return CALM_EVERY_S if calm else PROBE_EVERY_S


class QueueProbe:
    """Measures the server's call-queue delay and feeds it to a Door."""

    def __init__(self, door: Door, metrics: RouterMetrics, clock: Clock) -> None:
        self._door = door
        self._clock = clock
        self._metrics = metrics
        self._folder: Path | None = None
        self.address = ""
        """Where the server listens for the probe (`listen_on` sets it)."""
        self.token = secrets.token_hex(16)
        """Marks the probe's calls (`PROBE_KEY` metadata)."""
        self._out_since: float | None = None
        self._next_mark = 0.0
        """The outstanding probe's age at which it next counts as a sample (0: it has not counted yet)."""
        self._task: asyncio.Task[None] | None = None
        self._timer: Timer | None = None
        self._traffic = asyncio.Event()
        """Set when a client inference call came in since the last probe."""
        self.probes = 0
        """Probes sent so far."""

    def listen_on(self, server: grpc.aio.Server) -> None:
        """Make the socket's private folder and have `server` (not started yet) listen in it too."""
        self._folder = Path(tempfile.mkdtemp(prefix="sluice-router-"))
        self.address = f"unix:{self._folder / 'probe.sock'}"
        server.add_insecure_port(self.address)

    def arrived(self) -> None:
        """A client inference call reached the door (not the probe's own)."""
        self._traffic.set()

    def start(self) -> None:
        """Begin probing the running server (unless the door is off: nothing would read the samples)."""
        if self._door.max_delay_s <= 0:
            return
        self._task = asyncio.create_task(self._probe(), name="queue-probe")

    async def stop(self) -> None:
        """Stop probing and remove the socket's folder. Waits at most `STOP_WAIT_S` for the probe's call
        to end (`wait_until`, which neither raises the probe's outcome nor swallows a cancellation of
        the caller, as awaiting the cancelled task inside `suppress(CancelledError)` would)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            await wait_until(self._clock, {self._task}, self._clock.now() + STOP_WAIT_S)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    async def _probe(self) -> None:
        clock = self._clock
        async with grpc.aio.insecure_channel(self.address) as channel:
            infer: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(INFER)
            metadata = ((PROBE_KEY, self.token),)
            while True:
                if not self._door.engaged:
                    await self._traffic.wait()
                self._traffic.clear()
                started = self._out_since = clock.now()
                self._next_mark = self._door.max_delay_s
                self._timer = clock.call_at(started + self._next_mark, self._watch)
                self.probes += 1
                counted = False
                try:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await infer(b"", metadata=metadata, timeout=PROBE_TIMEOUT_S)
                        counted = self._next_mark > self._door.max_delay_s
                finally:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._out_since = None
                if not counted:
                    now = clock.now()
                    self._report(now - started, now)
                await clock.sleep(pause_after(self._door))

    def _report(self, delay: float, now: float) -> None:
        self._door.observe(delay, now)
        self._metrics.call_delay.set(delay)
        self._metrics.door_fraction.set(self._door.fraction)

    def _watch(self) -> None:
        """The outstanding probe's age has reached its next mark (the bound, then each doubling): one
        sample, and a timer for the next mark. The sample is never under the mark: uvloop times its timers
        on a cached millisecond clock, so one fires up to a millisecond early by `time.monotonic()`, and a
        first mark read as 29.7 ms against a 30 ms bound counted as a wait under the bound. Every such
        sample restarted the door's sustain: at 1.1x the router's capacity it stayed open for 3-6 s and
        more while calls waited 60-240 ms (docs/performance.md, "The late evening of 2026-12-03")."""
        if self._out_since is None:
            return
        now = self._clock.now()
        self._report(max(now - self._out_since, self._next_mark), now)
        self._next_mark *= 2
        self._timer = self._clock.call_at(self._out_since + self._next_mark, self._watch)
