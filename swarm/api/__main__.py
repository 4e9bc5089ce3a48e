"""``python -m swarm.api``: an OpenAI-compatible HTTP API (and the swarm's web dashboard with a chat page) over a
running swarm. It joins the swarm as a client of each ``--model``, keeps their embeddings and heads locally, and
prints ``api: http://HOST:PORT`` once it listens."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator

from swarm.api.config import ApiConfig
from swarm.cli import add_flags, from_args
from swarm.errors import BadInputError, run_command
from swarm.hub import add_token_flag, use_token
from swarm.logs import add_log_flags, configure_logging
from swarm.rpc.loop import run as run_loop

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.api", description=__doc__)
    add_flags(p, ApiConfig)
    p.add_argument("--test-timings", action="store_true", help="short record TTLs and timeouts, for tests")
    add_token_flag(p)
    add_log_flags(p)
    return p


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


async def serve(cfg: ApiConfig, test_timings: bool) -> None:
    import uvicorn

    from swarm.api.service import Service
    from swarm.dashboard.guard import Guard

    if not cfg.initial_peers:
        raise BadInputError("give --initial-peers of a running swarm")
    limits, connections = cfg.limits.limits(), cfg.connections.limits(cfg.limits.max_concurrent)
    sock = _listen(cfg.host, cfg.port)
    service = await asyncio.to_thread(Service.start, cfg, limits, cfg.keys(), test_timings)
    service.state.body_timeout = cfg.connections.body_timeout

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        watcher = asyncio.create_task(service.watch_failovers())
        try:
            yield
        finally:
            watcher.cancel()

    app = service.app(lifespan)
    # Not uvicorn's limit_concurrency: it counts every open connection, idle ones from anyone included, so a few
    # dozen sockets would get key holders 503. The guard's protocol (uvicorn's h11 one, subclassed) cuts idle and
    # slow connections and counts key holders' requests apart from everyone else's (swarm.dashboard.guard).
    guard = Guard(connections, service.state.access, on_cut=service.state.metrics.connection_cut)
    service.state.metrics.watch_connections(guard.counts)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=3,
            http=guard.protocol(),
            ws="none",
            timeout_keep_alive=int(connections.keep_alive_timeout) or 1,
        )
    )

    def stop(sig: int, frame: object) -> None:
        server.should_exit = True

    # uvicorn catches SIGTERM and Ctrl-C while it serves, shuts down, then raises the signal again with the handlers
    # it found: these, so that the swarm client is closed too (its DHT, p2pd) and the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    if cfg.dashboard:
        service.attach_dashboard(app, lambda: bool(server.should_exit))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"api: http://{shown}:{port}", flush=True)
        await task
    finally:
        await asyncio.to_thread(service.close)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    use_token(args.token)
    cfg = from_args(ApiConfig, args)
    return run_command(lambda: run_loop(serve(cfg, args.test_timings)))


if __name__ == "__main__":
    sys.exit(main())
