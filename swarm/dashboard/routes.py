"""The dashboard's HTTP routes: its pages, the swarm's state as JSON and as server-sent events, and the static files
the pages load. Nothing is fetched from anywhere else: every page carries a Content-Security-Policy that allows only
this origin (no inline script, no CDN).

With an ``Access`` that requires keys (the API's ``--api-key``), the pages, the state and the event stream are a key
holder's only (``swarm.dashboard.access``): a program sends ``Authorization: Bearer KEY``; a browser gets a login form
(401) at ``/dashboard`` or ``/chat``, posts the key to the same address once and is sent back with a cookie. Anyone
else sees the form and the static files (the pages' code), never a peer or an address."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from swarm.dashboard.access import COOKIE, Access
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
MAX_LOGIN_BYTES = 4096  # the login form's body
LOGIN_TIMEOUT = 10.0  # seconds for the login form's body to arrive
LOGIN_HEADERS = {**SECURITY_HEADERS, "Content-Security-Policy": CSP.replace("form-action 'none'", "form-action 'self'")}


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


def _login_page(status: int = 401) -> Response:
    headers = {**LOGIN_HEADERS, "WWW-Authenticate": 'Bearer realm="swarm"'}
    return Response((STATIC / "login.html").read_bytes(), status, media_type=TYPES[".html"], headers=headers)


async def _form_key(request: Request) -> str:
    """The ``key`` field of a posted login form ("" if there is none, the body is too large or too slow)."""
    body = b""
    try:
        async with asyncio.timeout(LOGIN_TIMEOUT):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_LOGIN_BYTES:
                    return ""
    except TimeoutError:
        return ""
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    return fields.get("key", [""])[0].strip()


def dashboard_router(
    observers: Mapping[str, SwarmObserver],
    *,
    chat: bool,
    stopping: Callable[[], bool] = lambda: False,
    access: Access | None = None,
) -> APIRouter:
    """The dashboard (and, with ``chat``, the chat page, which talks to the API's /v1 routes) over ``observers``:
    model id -> the observer of that model's swarm. ``stopping``: true once the server shuts down (uvicorn's
    ``lambda: server.should_exit``), so live event streams end instead of holding the shutdown. ``access``: the keys
    that open the pages, state and events (None or no keys: open to whoever reaches the server)."""
    router = APIRouter()
    gate = access or Access()
    _add_pages(router, gate, chat)
    _add_data(router, gate, observers, chat, stopping)
    _add_files(router)
    return router


def _add_pages(router: APIRouter, gate: Access, chat: bool) -> None:
    """The pages (a login form in their place without a key) and the login each page's address takes."""

    def allowed(request: Request) -> bool:
        return gate.allows(request.headers, request.cookies)

    async def login(request: Request) -> Response:
        """The login form posted to a page's own address: a valid key is answered with that page and a cookie."""
        token = gate.cookie_for(await _form_key(request))
        if token is None:
            return _login_page()
        back = RedirectResponse(request.url.path, status_code=303, headers={"Cache-Control": "no-store"})
        back.set_cookie(COOKIE, token, path="/", httponly=True, samesite="strict")
        return back

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    @router.get("/dashboard", include_in_schema=False)
    def dashboard(request: Request) -> Response:
        return _page("dashboard.html") if allowed(request) else _login_page()

    router.add_api_route("/dashboard", login, methods=["POST"], include_in_schema=False)

    if chat:

        @router.get("/chat", include_in_schema=False)
        def chat_page(request: Request) -> Response:
            return _page("chat.html") if allowed(request) else _login_page()

        router.add_api_route("/chat", login, methods=["POST"], include_in_schema=False)


def _add_data(
    router: APIRouter,
    gate: Access,
    observers: Mapping[str, SwarmObserver],
    chat: bool,
    stopping: Callable[[], bool],
) -> None:
    """The swarm's state, whole and as live events (at most ``MAX_STREAMS`` at once), for key holders only."""
    streams = [0]

    def refuse_data(request: Request) -> None:
        if not gate.allows(request.headers, request.cookies):
            raise HTTPException(401, "this dashboard requires an API key: 'Authorization: Bearer KEY' or its login")

    @router.get("/dashboard/state")
    def dashboard_state(request: Request) -> JSONResponse:
        refuse_data(request)
        return JSONResponse(state(observers, chat), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/events")
    def dashboard_events(request: Request) -> StreamingResponse:
        refuse_data(request)
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


def _add_files(router: APIRouter) -> None:
    """The pages' static files (scripts, styles, the icon)."""
    files = static_files()

    @router.get("/favicon.ico", include_in_schema=False)
    def favicon() -> RedirectResponse:
        return RedirectResponse("/static/favicon.svg", status_code=307)

    @router.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        path = files.get(name)
        if path is None:
            raise HTTPException(404, "no such file")
        return Response(path.read_bytes(), media_type=TYPES[path.suffix], headers=SECURITY_HEADERS)
