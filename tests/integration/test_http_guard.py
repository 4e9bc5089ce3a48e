"""The HTTP servers' connection guard (``swarm.dashboard.guard``) on real sockets, in front of a small app served by
uvicorn on a thread as the API and the peers' dashboards are: a connection that sends nothing or trickles its head is
cut at its head deadline, one that stops reading a response at its write deadline, a flood of idle sockets cuts only
its own oldest, and requests without a key have a pool of their own. Outcomes are asserted, not durations: each wait
is a bound on a hang only, and the server's own count says why it cut each connection."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from swarm.dashboard.access import Access
from swarm.dashboard.guard import ConnectionLimits, Guard
from swarm.dashboard.server import ThreadedServer, serve_in_thread
from tests.helpers.swarms import closed_by_peer, wait_for

KEY = "guard-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
BOUND = 60.0  # seconds: far beyond every deadline here, so only a server that never acts fails


def _app(release: threading.Event) -> Starlette:
    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def hold(request: Request) -> PlainTextResponse:
        await asyncio.to_thread(release.wait, BOUND)
        return PlainTextResponse("held")

    async def endless(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            while True:  # uvicorn drops what is sent on a closed connection: the await lets the cancel land
                await asyncio.sleep(0)
                yield b"x" * 65536

        return StreamingResponse(chunks())

    return Starlette(routes=[Route("/", ok), Route("/hold", hold), Route("/endless", endless)])


@contextlib.contextmanager
def _serving(**limits: float) -> Iterator[tuple[ThreadedServer, Guard, threading.Event]]:
    release = threading.Event()
    guard = Guard(ConnectionLimits(**limits), Access((KEY,)))  # type: ignore[arg-type]
    server = serve_in_thread(_app(release), "127.0.0.1", 0, "guard-test", guard)
    try:
        yield server, guard, release
    finally:
        release.set()
        server.close()


def _connect(server: ThreadedServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=BOUND)


def test_silent_and_trickling_connections_are_cut_at_their_head_deadline():
    with _serving(header_timeout=1.0) as (server, guard, _):
        silent, trickling = _connect(server), _connect(server)
        head = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 400
        deadline = time.monotonic() + BOUND
        while not closed_by_peer(trickling) and time.monotonic() < deadline:
            try:
                trickling.send(head[:1])  # a byte at a time: each one would have reset uvicorn's own timer
            except (BrokenPipeError, ConnectionResetError):
                break
            head = head[1:] or b"a"
            select.select([trickling], [], [], 0.1)
        wait_for(lambda: closed_by_peer(silent), BOUND, "the silent connection to be cut")
        assert guard.cut["header_timeout"] == 2 and not guard.open
        assert httpx.get(server.url + "/", timeout=BOUND).text == "ok"  # and the server serves on


def test_a_client_that_stops_reading_is_cut_at_its_write_deadline():
    with _serving(write_timeout=1.0) as (server, guard, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(BOUND)
        sock.connect((server.host, server.port))
        sock.sendall(f"GET /endless HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        wait_for(lambda: guard.cut["write_timeout"] == 1, BOUND, "the server to cut the reader that stopped")
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):  # what the kernels still held, then the end: the stream was endless
                received += len(chunk)
        assert received < 64 << 20
        sock.close()
        assert httpx.get(server.url + "/", timeout=BOUND).text == "ok"


def test_a_flood_of_idle_connections_cuts_only_its_own_oldest():
    with _serving(max_pending=8) as (server, guard, _):
        flood = [_connect(server) for _ in range(30)]
        wait_for(lambda: len(guard.open) == 8, BOUND, "the server to hold 8 pending connections")
        reply = httpx.get(server.url + "/", headers=BEARER, timeout=BOUND)  # a new connection, which shows a key
        assert reply.text == "ok"
        # the key holder's connection, pending until its head arrived, cut one more of the flood
        wait_for(lambda: all(closed_by_peer(s) for s in flood[:23]), BOUND, "the flood's oldest to be cut")
        assert guard.cut["evicted"] == 23 and not any(closed_by_peer(s) for s in flood[23:])
        for s in flood:
            s.close()


def test_requests_without_a_key_have_a_pool_of_their_own():
    with _serving(max_public_requests=1, max_requests=2) as (server, guard, release):
        with httpx.Client(base_url=server.url, timeout=BOUND) as outsider:
            held: list[httpx.Response] = []
            holder = threading.Thread(target=lambda: held.append(outsider.get("/hold")))
            holder.start()
            wait_for(lambda: guard.running[False] == 1, BOUND, "the outsider's request to run")
            refused = httpx.get(server.url + "/", timeout=BOUND)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "busy"
            assert httpx.get(server.url + "/", headers=BEARER, timeout=BOUND).text == "ok"  # key holders: served
            release.set()
            holder.join(BOUND)
            assert held[0].text == "held"
