"""What a peer shows about itself over HTTP, off the serving path: Prometheus metrics (``--metrics-port``,
``peers.metrics``) and the swarm's live web dashboard (``--dashboard-port``, ``swarm.dashboard``). Each listens on
``--http-host`` (loopback by default) and prints its address on stdout (``metrics: URL``, ``dashboard: URL``) so
launchers that asked for port 0 learn the port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peers.config import ObserveConfig
    from peers.node import Peer
    from swarm.config import Timing
    from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)


class Observers:
    """The HTTP side servers a peer runs; ``close`` stops them all."""

    def __init__(self) -> None:
        self._closers: list[Callable[[], None]] = []
        self.urls: dict[str, str] = {}

    def add(self, name: str, url: str, close: Callable[[], None]) -> None:
        self.urls[name] = url
        self._closers.append(close)
        print(f"{name}: {url}", flush=True)

    def close(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        self._closers.clear()


async def start_observers(cfg: ObserveConfig, peer: Peer, remote: Remote, timing: Timing) -> Observers:
    observers = Observers()
    try:
        if cfg.metrics_port is not None:
            start_metrics(observers, cfg, peer, remote)
        if cfg.dashboard_port is not None:
            await start_dashboard(observers, cfg, peer, remote, timing)
    except BaseException:
        observers.close()
        raise
    return observers


def start_metrics(observers: Observers, cfg: ObserveConfig, peer: Peer, remote: Remote | None = None) -> None:
    """Prometheus metrics of this peer (``peers.metrics``) at ``/metrics``, served by prometheus_client's own
    threaded HTTP server: a scrape never runs on the RPC loop."""
    from prometheus_client import start_http_server

    assert cfg.metrics_port is not None
    registry = peer.compute.metrics.watch(peer, remote, asyncio.get_running_loop())
    server, thread = start_http_server(cfg.metrics_port, addr=cfg.http_host, registry=registry)
    port = server.server_address[1]  # the bound port: --metrics-port 0 takes any free one

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    host = f"[{cfg.http_host}]" if ":" in cfg.http_host else cfg.http_host
    observers.add("metrics", f"http://{host}:{port}/metrics", close)


async def start_dashboard(observers: Observers, cfg: ObserveConfig, peer: Peer, remote: Remote, timing: Timing) -> None:
    """The swarm's dashboard as this peer sees it (``swarm.dashboard``): an observer refreshing on this peer's loop
    from its own DHT peer and transport, served (without the chat page) by uvicorn on a background thread."""
    from fastapi import FastAPI

    from swarm.dashboard.attach import start_observer_task
    from swarm.dashboard.routes import dashboard_router
    from swarm.dashboard.server import serve_in_thread

    assert cfg.dashboard_port is not None
    model = peer.model
    observer, task = start_observer_task(peer.store, remote, model.name, model.num_blocks, timing, own_info=peer.info)
    try:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        exiting = threading.Event()
        app.include_router(dashboard_router({model.name: observer}, chat=False, stopping=exiting.is_set))
        server = await asyncio.to_thread(serve_in_thread, app, cfg.http_host, cfg.dashboard_port, "dashboard")
    except BaseException:
        task.cancel()
        raise

    def close() -> None:
        task.cancel()
        exiting.set()  # open event streams end within a tick, so uvicorn need not cut them
        server.close(timing.shutdown_timeout)

    observers.add("dashboard", server.url + "/dashboard", close)
