"""Keeping a route's hops alive while one of them is repaired. A server ends an inference session that hears nothing
for ``Timing.session_idle`` (and frees its room); while the client finds a new server for one hop and replays that
hop's history onto it, the route's other hops hear nothing. Where a repair takes longer than the idle limit (a loaded
machine, a long history, the tests' 5 s), they all end their sessions meanwhile, and the next steps find them one at
a time, each repair long enough to let the rest expire again: the client runs out of its retry budget (seen with 24
peers on 2 cores, ``tests/integration/test_scale.py``). So during a repair every other open hop is sent a message
without a step, at once and then every third of the idle limit: any message resets a server's idle clock, and the
server answers it with the signed head of its chain of commitments (checked against the sealed chain on a chained
hop; read and dropped on a mediated one, whose outputs are checked step by step)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from swarm.client.session.hop import HopState

KeepAlive = Callable[[list[HopState]], Awaitable[None]]


@contextlib.asynccontextmanager
async def kept_alive(states: list[HopState], keep: KeepAlive, idle: float) -> AsyncIterator[None]:
    """While the body runs, ``keep`` (the step path's ``keep_alive``) every open, unbroken hop of ``states``: at once,
    then every ``idle`` / 3 seconds. The ticker is stopped between two rounds, never inside one (a message cut
    halfway would break its stream)."""
    stop = asyncio.Event()

    async def tick() -> None:
        while True:
            await keep([s for s in states if s.link.stream is not None and not s.link.broken])
            try:
                await asyncio.wait_for(stop.wait(), idle / 3)
                return
            except TimeoutError:
                continue

    task = asyncio.create_task(tick())
    try:
        yield
    finally:
        stop.set()
        await task
