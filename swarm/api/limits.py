"""What one caller, and all callers together, may hold of the API at once. A request over a limit is answered at once
with 429 (never queued: a queue would only move the wait into the caller's timeout), and a body over its limit with
400 before it is parsed. A caller is its API key when keys are required, else its address."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import Counter
from dataclasses import dataclass

from starlette.requests import Request

from swarm.api import errors


@dataclass(frozen=True)
class Limits:
    # generations at once, all callers: their decode steps batch on the servers and share the client's head, and
    # each is a session on every server of its route (a server takes 16 of one caller by default)
    max_concurrent: int = 16
    max_client_concurrent: int = 4  # ...and of one caller
    max_tokens: int = 1024  # largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    request_timeout: float = 300.0  # seconds one generation may run

    def check(self) -> None:
        if min(self.max_concurrent, self.max_client_concurrent, self.max_tokens, self.max_body_bytes) < 1:
            raise ValueError("every API limit must be at least 1")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")


class Slots:
    """Counts of running generations, all callers and per caller (thread-safe: the counts are tiny, the lock is
    never held across an await)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._per: Counter[str] = Counter()
        self.total = 0

    def acquire(self, caller: str) -> None:
        """Take a slot for ``caller`` or raise 429; every acquire is paired with one ``release``."""
        with self._lock:
            if self.total >= self.limits.max_concurrent:
                raise errors.too_many(f"the server is running {self.total} requests, its limit: retry later")
            if self._per[caller] >= self.limits.max_client_concurrent:
                raise errors.too_many(
                    f"you have {self._per[caller]} requests running, the limit per caller: wait for one to finish"
                )
            self.total += 1
            self._per[caller] += 1

    def release(self, caller: str) -> None:
        with self._lock:
            self.total -= 1
            self._per[caller] -= 1
            if not self._per[caller]:
                del self._per[caller]


def caller_of(request: Request, key: str | None) -> str:
    if key is not None:  # never the key itself in memory dumps or logs: a short hash names the caller
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "addr:" + (request.client.host if request.client else "unknown")


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The request body, refused with 400 as soon as it exceeds ``limit`` bytes (whatever Content-Length says) or
    takes longer than ``timeout`` seconds to arrive (a caller trickling bytes holds a connection, not a slot)."""
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit)
    except TimeoutError:
        raise errors.bad_request(f"the request body took over {timeout:.0f} s to arrive") from None


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.bad_request(f"the request body is {declared} bytes; this server takes at most {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.bad_request(f"the request body exceeds {limit} bytes, this server's limit")
        chunks.append(chunk)
    return b"".join(chunks)
