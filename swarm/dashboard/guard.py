"""Connections to an HTTP server (the API, a peer's dashboard) that cannot crowd out the callers who hold its key, and
cannot hold the server's memory by going quiet.

Why not uvicorn's own options: its ``limit_concurrency`` counts every open connection and every running request, a
connection that never sent a byte included, so a few dozen idle sockets from anyone make it answer 503 to everyone;
and its only timeout, ``timeout_keep_alive``, runs between requests, is reset by every byte received and never runs
before a connection's first request, so a client that sends nothing, or a header a byte at a time, holds its
connection forever. Nor does anything cut a client that stops reading a response.

So the server's HTTP protocol is uvicorn's own h11 protocol (``H11Protocol``), subclassed to add, per connection:

- a **head deadline**: a request's line and headers must have arrived ``header_timeout`` s after the connection opened
  or the previous response ended, or the connection is cut (whatever it trickled meanwhile);
- a **write deadline**: when the connection's write buffer is full (the client stopped reading), it must drain within
  ``write_timeout`` s, or the connection is cut;
- **pending connections** (no request from them yet, or only requests without a valid key) are capped at
  ``max_pending``: a new connection beyond cuts the oldest pending one, so a flood of idle sockets only cuts itself;
  all connections together are capped at ``max_connections`` (the newest is refused when none is pending);
- and, around the app, two **pools of requests** running at once: key holders' (``max_requests``) and everyone
  else's (``max_public_requests``, small), each answered 503 at once beyond its size. A connection that shows a valid
  key leaves the pending ones for good.

Memory is then bounded: at most ``max_connections`` sockets, each buffering at most h11's incomplete-event limit of
request head (16 KiB) and uvicorn's high-water mark of body and of response."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from swarm.dashboard.access import Access

REASONS = ("header_timeout", "write_timeout", "evicted", "refused")  # why the server cut a connection


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds for a request's head to arrive
    write_timeout: float = 30.0  # seconds for a full write buffer to drain
    keep_alive_timeout: float = 5.0  # seconds an idle kept-alive connection stays open (uvicorn's own)
    max_connections: int = 1024  # open connections, all together
    max_pending: int = 256  # ...of which without a key shown (the oldest is cut for a new one)
    max_requests: int = 64  # requests of key holders running at once; 503 beyond
    max_public_requests: int = 16  # requests without a valid key running at once; 503 beyond

    def check(self) -> None:
        if min(self.header_timeout, self.write_timeout, self.keep_alive_timeout) <= 0:
            raise ValueError("every connection timeout must be positive")
        if min(self.max_connections, self.max_pending, self.max_requests, self.max_public_requests) < 1:
            raise ValueError("every connection limit must be at least 1")
        if self.max_pending > self.max_connections:
            raise ValueError("--max-pending-connections cannot exceed --max-connections")


class Guard:
    """The shared state of one server's guarded connections: which are pending (oldest first), how many requests of
    each pool run, and how many connections were cut for each reason."""

    def __init__(
        self,
        limits: ConnectionLimits,
        access: Access,
        on_cut: Callable[[str], None] | None = None,
    ) -> None:
        limits.check()
        self.limits, self.access = limits, access
        self.pending: collections.OrderedDict[GuardedProtocol, None] = collections.OrderedDict()
        self.open: set[GuardedProtocol] = set()
        self.running = {True: 0, False: 0}  # requests running now, key holders' (True) and the others'
        self.cut: collections.Counter[str] = collections.Counter()
        self._on_cut = on_cut

    def protocol(self) -> type[GuardedProtocol]:
        """The protocol class to give uvicorn (``uvicorn.Config(http=...)``): uvicorn builds one per connection."""
        guard = self

        class Bound(GuardedProtocol):
            def __init__(self, *args: object, **kwargs: object) -> None:  # uvicorn's, passed on
                super().__init__(*args, guard=guard, **kwargs)

        return Bound

    def counts(self) -> dict[str, int]:
        return {"pending": len(self.pending), "authenticated": len(self.open) - len(self.pending)}

    def note_cut(self, reason: str) -> None:
        self.cut[reason] += 1
        if self._on_cut is not None:
            with contextlib.suppress(Exception):
                self._on_cut(reason)

    def admit(self, conn: GuardedProtocol) -> bool:
        """Take a new connection in (False: refused, the server is full of key holders' connections)."""
        while self.pending and (
            len(self.pending) >= self.limits.max_pending or len(self.open) >= self.limits.max_connections
        ):
            oldest = next(iter(self.pending))
            self.forget(oldest)
            oldest.cut("evicted")
        if len(self.open) >= self.limits.max_connections:
            return False
        self.open.add(conn)
        self.pending[conn] = None
        return True

    def forget(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.pending.pop(conn, None)

    def authenticated(self, conn: GuardedProtocol) -> None:
        self.pending.pop(conn, None)


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, the pending cap and the request pools of ``Guard``."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:  # Any: uvicorn's, passed on (its app_state)
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.inner: ASGIApp = self.app
        self.app = self._guarded  # what uvicorn runs for each request of this connection
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # cast: asyncio gives a stream protocol its stream's Transport (uvicorn narrows asyncio.Protocol's parameter)
        super().connection_made(cast(asyncio.Transport, transport))
        if not self.guard.admit(self):
            self.cut("refused")
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head()  # the next request's head is due as the first one's was

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.guard.limits.write_timeout, self.cut, "write_timeout")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def cut(self, reason: str) -> None:
        """Close the connection now, whatever it buffers (``abort``: ``close`` would wait for a client that does
        not read)."""
        if self.transport.is_closing():
            return
        self.guard.note_cut(reason)
        self.transport.abort()

    def _arm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.guard.limits.header_timeout, self.cut, "header_timeout")

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._head_timer is not None:  # the head has arrived (uvicorn runs the app only then)
            self._head_timer.cancel()
            self._head_timer = None
        request = HTTPConnection(scope)
        holder = self.guard.access.allows(request.headers, request.cookies)
        if holder:
            self.guard.authenticated(self)
        running, limits = self.guard.running, self.guard.limits
        if running[holder] >= (limits.max_requests if holder else limits.max_public_requests):
            await _unavailable(send, holder)
            return
        running[holder] += 1
        try:
            await self.inner(scope, receive, send)
        finally:
            running[holder] -= 1


async def _unavailable(send: Send, holder: bool) -> None:
    """503 in OpenAI's error shape, with ``Retry-After``."""
    message = "the server is answering too many requests" + ("" if holder else " without an API key")
    body = json.dumps(
        {"error": {"message": message + ": retry later", "type": "server_error", "param": None, "code": "busy"}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
