"""Every event loop of the project: uvloop's (libuv; its transports, TLS and timers are C, not Python, which a decode
step's messages go through a dozen times per hop), made by ``new_loop``; ``run`` for a process's main loop, and a
private loop on a background thread (``LoopThread``), owned by one object (no process-wide state), so synchronous
code (the torch API, the node's loader threads) can drive hivemind's async P2P calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TypeVar

import uvloop

T = TypeVar("T")


def new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop()


def run(main: Coroutine[object, None, T]) -> T:
    """``asyncio.run`` on a new loop of ``new_loop``'s (a server's, the HTTP API's main loop)."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)


class LoopThread:
    def __init__(self, name: str = "swarm-rpc") -> None:
        self.loop = new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Cancel and await whatever still runs on the loop (hivemind's daemon readers among it), then stop it:
        a loop closed with pending tasks prints "Task was destroyed but it is pending!" when they are collected."""
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            try:
                self.run(_drain(), timeout)
            except Exception:  # noqa: S110 - best effort at exit; the loop is stopped below either way
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self.loop.is_running():
            self.loop.close()


async def _drain() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
