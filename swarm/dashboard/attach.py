"""Run a ``SwarmObserver`` on an event loop that already exists: a client connection's ``LoopThread`` (the API
process) or a peer's own loop (``swarm.dashboard.peer``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol

from swarm.config import Timing
from swarm.dashboard.observer import SwarmObserver
from swarm.dht import RecordStore
from swarm.protocol import InfoReply
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote

REFRESH_PERIOD = 1.0  # seconds between snapshots


class Connection(Protocol):
    """What an observer needs of a client's connection (``swarm.client.connection.SwarmConnection`` has it; the
    dashboard does not import the client)."""

    loop: LoopThread
    store: RecordStore
    remote: Remote
    timing: Timing
    model_id: str  # what the swarm's records are keyed by


def start_observer_on(
    loop_thread: LoopThread,
    store: RecordStore,
    remote: Remote,
    model_id: str,
    num_blocks: int,
    timing: Timing,
    period: float = REFRESH_PERIOD,
) -> tuple[SwarmObserver, Callable[[], None]]:
    """An observer of ``model_id``'s swarm refreshing every ``period`` s on ``loop_thread``'s loop (where ``remote``
    lives), and the function that stops it (idempotent; call it before the connection closes).

    In the API: ``observer, stop = start_observer_on(conn.loop, conn.store, conn.remote, model_id, num_blocks,
    conn.timing)``."""
    observer = SwarmObserver(store, remote, model_id, num_blocks, timing)

    async def start() -> asyncio.Task[None]:
        return asyncio.create_task(observer.run(period), name=f"dashboard-{model_id}")

    task = loop_thread.run(start())

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def stop() -> None:
        """Returns once the observer's task has ended (or after the shutdown timeout): no round runs after it."""
        if task.done():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, Exception):
            loop_thread.run(cancel(), timing.shutdown_timeout)

    return observer, stop


def start_observer_task(
    store: RecordStore,
    remote: Remote,
    model_id: str,
    num_blocks: int,
    timing: Timing,
    period: float = REFRESH_PERIOD,
    own_info: Callable[[], InfoReply] | None = None,
) -> tuple[SwarmObserver, asyncio.Task[None]]:
    """The same on the running loop (a peer's, whose own live stats ``own_info`` gives): cancel the task to stop
    it."""
    observer = SwarmObserver(store, remote, model_id, num_blocks, timing, own_info=own_info)
    return observer, asyncio.create_task(observer.run(period), name=f"dashboard-{model_id}")


def observe_connections(
    connections: Mapping[str, tuple[Connection, int]], period: float = REFRESH_PERIOD
) -> tuple[dict[str, SwarmObserver], Callable[[], None]]:
    """An observer per served model, each on its client connection's loop: ``connections`` maps a model's served
    name to (its ``SwarmConnection``, its number of blocks). Returns the observers by served name (what
    ``dashboard_router`` takes, and what ``note`` failovers on) and one function that stops them all (call it before
    the connections close).

    Each observer watches its connection's model id, not the served name: a folder is served under the path it was
    given (``--model ./folder``) while its swarm's records carry the folder's name."""
    observers: dict[str, SwarmObserver] = {}
    stops: list[Callable[[], None]] = []
    for name, (conn, num_blocks) in connections.items():
        observers[name], stop = start_observer_on(
            conn.loop, conn.store, conn.remote, conn.model_id, num_blocks, conn.timing, period
        )
        stops.append(stop)

    def stop_all() -> None:
        for stop in stops:
            stop()

    return observers, stop_all
