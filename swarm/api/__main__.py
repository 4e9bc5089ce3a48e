"""``python -m swarm.api``: an OpenAI-compatible HTTP API (and the swarm's web dashboard with a chat page) over a
running swarm. It joins the swarm as a client of each ``--model``, keeps their embeddings and heads locally, and
prints ``api: http://HOST:PORT`` once it listens."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from swarm.api.limits import Limits
from swarm.cli import add_flags, from_args, option
from swarm.errors import BadInputError, run_command
from swarm.logs import add_log_flags, configure_logging

log = logging.getLogger(__name__)


def _key_file(text: str) -> Path:
    return Path(text)


@dataclass(frozen=True)
class ApiLimits:
    """What one caller, and all together, may ask of the API (``swarm.api.limits``)."""

    max_concurrent: int = option(Limits.max_concurrent, help="generations running at once, all callers together")
    max_client_concurrent: int = option(Limits.max_client_concurrent, help="...and of one caller (key or address)")
    max_tokens_limit: int = option(Limits.max_tokens, help="largest max_tokens a request may ask for")
    max_body_kb: int = option(Limits.max_body_bytes // 1024, help="largest request body, in KiB")
    request_timeout: float = option(Limits.request_timeout, help="seconds one generation may run")

    def limits(self) -> Limits:
        out = Limits(
            self.max_concurrent,
            self.max_client_concurrent,
            self.max_tokens_limit,
            self.max_body_kb * 1024,
            self.request_timeout,
        )
        try:
            out.check()
        except ValueError as e:
            raise BadInputError(str(e)) from None
        return out


@dataclass(frozen=True)
class ApiConfig:
    """Everything ``python -m swarm.api`` accepts."""

    models: tuple[str, ...] = option(
        ("smollm2-135m",), name="--model", metavar="NAME", help="model card name(s) or Hugging Face folder(s) to serve"
    )
    initial_peers: tuple[str, ...] = option((), help="peers of the running swarm", metavar="MADDR")
    host: str = option("127.0.0.1", help="address to listen on (loopback only by default)")
    port: int = option(8000, help="HTTP port (0 = any free port)")
    api_keys: tuple[str, ...] = option(
        (), name="--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (one of these keys)"
    )
    api_key_file: Path | None = option(
        None, parse=_key_file, metavar="FILE", help="...or keys read from this file, one per line"
    )
    swarm_key: Path | None = option(None, metavar="FILE", help="a private swarm's key file")
    threads: int = option(1, help="torch threads for the local embeddings and heads")
    max_context: int | None = option(None, help="cap on prompt + completion tokens (default: the model's context)")
    codec: str = option("auto", help="activations' codec: 'auto' (per link) or one to force, e.g. 'none'")
    dashboard: bool = option(True, help="do not serve the web dashboard and chat page")
    limits: ApiLimits = field(default_factory=ApiLimits)

    def keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            keys += [k.strip() for k in self.api_key_file.read_text().splitlines() if k.strip()]
        if any(len(k) < 8 for k in keys):
            raise BadInputError("an API key needs at least 8 characters")
        return tuple(keys)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.api", description=__doc__)
    add_flags(p, ApiConfig)
    p.add_argument("--test-timings", action="store_true", help="short record TTLs and timeouts, for tests")
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

    if not cfg.initial_peers:
        raise BadInputError("give --initial-peers of a running swarm")
    sock = _listen(cfg.host, cfg.port)
    service = await asyncio.to_thread(Service.start, cfg, cfg.limits.limits(), cfg.keys(), test_timings)

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        watcher = asyncio.create_task(service.watch_failovers())
        try:
            yield
        finally:
            watcher.cancel()

    app = service.app(lifespan)
    # open connections beyond the generations' slots (streams, dashboards, metrics) get 503 from uvicorn itself
    connections = cfg.limits.max_concurrent * 4 + 32
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, limit_concurrency=connections)
    )
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
    cfg = from_args(ApiConfig, args)
    return run_command(lambda: asyncio.run(serve(cfg, args.test_timings)))


if __name__ == "__main__":
    sys.exit(main())
