"""The dashboard's HTTP routes: its pages, the swarm's state as JSON and as server-sent events, and the static files
the pages load. Nothing is fetched from anywhere else: every page carries a Content-Security-Policy that allows only
this origin (no inline script, no CDN)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from swarm.dashboard.observer import SwarmObserver

STATIC = Path(__file__).parent / "static"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
PUSH_PERIOD = 1.0  # seconds between pushed snapshots
STREAM_LIFETIME = 600.0  # a stream ends after this long (the browser's EventSource reconnects by itself)
TICK = 0.1  # how often an idle stream checks whether the server is stopping
MAX_STREAMS = 64  # live streams at once, all clients together; more are refused with 503


def static_files() -> dict[str, Path]:
    """The files the routes serve, by name: exactly what lies in ``static/`` with a known type (nothing else is
    reachable, whatever the path asks for)."""
    return {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in TYPES}


def state(observers: Mapping[str, SwarmObserver], chat: bool) -> dict[str, object]:
    return {
        "v": 1,
        "chat": chat,
        "models": {name: obs.snapshot.model_dump(mode="json") for name, obs in observers.items()},
    }


async def event_stream(
    observers: Mapping[str, SwarmObserver],
    chat: bool,
    period: float = PUSH_PERIOD,
    lifetime: float = STREAM_LIFETIME,
    stopping: Callable[[], bool] = lambda: False,
) -> AsyncIterator[str]:
    """Server-sent events: the state at once, then whenever a snapshot changed (checked every ``period`` s), and a
    comment every 15 s so proxies keep the stream open. The server cancels it when the client disconnects; it ends
    by itself after ``lifetime`` s or as soon as ``stopping()`` (the server is shutting down: an open stream would
    otherwise hold the shutdown until uvicorn's graceful timeout)."""
    deadline = time.monotonic() + lifetime
    last: tuple[int, ...] = ()
    quiet = 0.0
    yield "retry: 2000\n\n"
    while time.monotonic() < deadline and not stopping():
        seen = tuple(id(obs.snapshot) for obs in observers.values())
        if seen != last:
            last, quiet = seen, 0.0
            yield f"data: {json.dumps(state(observers, chat), separators=(',', ':'))}\n\n"
        elif quiet >= 15.0:
            quiet = 0.0
            yield ": keep-alive\n\n"
        wake = time.monotonic() + period
        while time.monotonic() < wake and not stopping():
            await asyncio.sleep(min(TICK, period))
        quiet += period


def _page(name: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=TYPES[".html"], headers=SECURITY_HEADERS)


def dashboard_router(
    observers: Mapping[str, SwarmObserver], *, chat: bool, stopping: Callable[[], bool] = lambda: False
) -> APIRouter:
    """The dashboard (and, with ``chat``, the chat page, which talks to the API's /v1 routes) over ``observers``:
    model id -> the observer of that model's swarm. ``stopping``: true once the server shuts down (uvicorn's
    ``lambda: server.should_exit``), so live event streams end instead of holding the shutdown."""
    router = APIRouter()
    files = static_files()
    streams = [0]

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    @router.get("/dashboard", include_in_schema=False)
    def dashboard() -> Response:
        return _page("dashboard.html")

    if chat:

        @router.get("/chat", include_in_schema=False)
        def chat_page() -> Response:
            return _page("chat.html")

    @router.get("/dashboard/state")
    def dashboard_state() -> JSONResponse:
        return JSONResponse(state(observers, chat), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/events")
    def dashboard_events() -> StreamingResponse:
        if streams[0] >= MAX_STREAMS:
            raise HTTPException(503, "too many live dashboards")

        async def counted() -> AsyncIterator[str]:
            streams[0] += 1
            try:
                async for chunk in event_stream(observers, chat, stopping=stopping):
                    yield chunk
            finally:
                streams[0] -= 1

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(counted(), media_type="text/event-stream", headers=headers)

    @router.get("/favicon.ico", include_in_schema=False)
    def favicon() -> RedirectResponse:
        return RedirectResponse("/static/favicon.svg", status_code=307)

    @router.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        path = files.get(name)
        if path is None:
            raise HTTPException(404, "no such file")
        return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=SECURITY_HEADERS)

    return router
