"""What a peer shows about itself over HTTP, off the serving path: Prometheus metrics (``--metrics-port``,
``peers.metrics``) and the swarm's live web dashboard (``--dashboard-port``), which the entry point hands in
(``swarm.dashboard.peer``: the node imports no web app). Each listens on ``--http-host`` (loopback by default) and
prints its address on stdout (``metrics: URL``, ``dashboard: URL``) so launchers that asked for port 0 learn the
port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from peers.config import ObserveConfig
from peers.metrics import Snapshot, watch
from peers.serving.counters import PeerMetrics
from swarm.config import Timing
from swarm.dht import RecordStore
from swarm.protocol import InfoReply
from swarm.rpc.remote import Remote


class Dashboard(Protocol):
    """Serves the swarm's dashboard as this peer sees it; returns its URL and the function that stops it."""

    def __call__(
        self,
        store: RecordStore,
        remote: Remote,
        model_id: str,
        num_blocks: int,
        timing: Timing,
        own_info: Callable[[], InfoReply],
        host: str,
        port: int,
    ) -> Awaitable[tuple[str, Callable[[], None]]]: ...


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


def start_metrics(observers: Observers, cfg: ObserveConfig, counters: PeerMetrics, snapshot: Snapshot) -> None:
    """Prometheus metrics of this peer (``peers.metrics``) at ``/metrics``, served by prometheus_client's own
    threaded HTTP server: a scrape never runs on the RPC loop (it asks the loop for a snapshot)."""
    from prometheus_client import start_http_server

    assert cfg.metrics_port is not None
    registry = watch(counters, snapshot, asyncio.get_running_loop())
    server, thread = start_http_server(cfg.metrics_port, addr=cfg.http_host, registry=registry)
    port = server.server_address[1]  # the bound port: --metrics-port 0 takes any free one

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    host = f"[{cfg.http_host}]" if ":" in cfg.http_host else cfg.http_host
    observers.add("metrics", f"http://{host}:{port}/metrics", close)
