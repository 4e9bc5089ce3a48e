"""A peer's own dashboard (``python -m swarm.serve --dashboard-port``): the swarm as that peer sees it, from its own
DHT peer and transport, refreshing on its loop and served (without the chat page) by uvicorn on a background thread.
The serve entry point hands ``serve_peer_dashboard`` to the node, which imports no web app."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from swarm.config import Timing
from swarm.dashboard.attach import start_observer_task
from swarm.dht import RecordStore
from swarm.protocol import InfoReply
from swarm.rpc.remote import Remote


async def serve_peer_dashboard(
    store: RecordStore,
    remote: Remote,
    model_id: str,
    num_blocks: int,
    timing: Timing,
    own_info: Callable[[], InfoReply],
    host: str,
    port: int,
) -> tuple[str, Callable[[], None]]:
    """Start the dashboard on the running loop and a server thread; returns its URL and the function that stops it."""
    from fastapi import FastAPI

    from swarm.dashboard.routes import dashboard_router
    from swarm.dashboard.server import serve_in_thread

    observer, task = start_observer_task(store, remote, model_id, num_blocks, timing, own_info=own_info)
    try:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        exiting = threading.Event()
        app.include_router(dashboard_router({model_id: observer}, chat=False, stopping=exiting.is_set))
        server = await asyncio.to_thread(serve_in_thread, app, host, port, "dashboard")
    except BaseException:
        task.cancel()
        raise

    def close() -> None:
        task.cancel()
        exiting.set()  # open event streams end within a tick, so uvicorn need not cut them
        server.close(timing.shutdown_timeout)

    return server.url + "/dashboard", close
