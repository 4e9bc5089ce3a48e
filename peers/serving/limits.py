"""Who is calling, and how much of the server one caller and all callers together may hold.

Every limit is kept twice: per caller (the authenticated peer id of the stream, so a caller cannot pose as another)
and in total (so many identities together, which cost an attacker nothing to make, still cannot exhaust the server).
Going over either answers ``BusyError`` naming the limit; nothing waits, so a flood costs the server no memory.

Streams are bounded in time as well: a caller that opens a stream and then sends nothing, or sends the first frame
of a message and trickles the rest, would otherwise hold its session, its cache room and a task forever."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Protocol

from swarm import wire
from swarm.errors import BusyError

ANONYMOUS = "anonymous"  # a caller whose transport names no identity: all of them share one identity's limits


class PeerIdLike(Protocol):
    def to_base58(self) -> str: ...


class CallerContext(Protocol):
    """What a handler learns of its caller: hivemind's ``P2PContext``, or the direct-TCP server's context."""

    @property
    def remote_id(self) -> PeerIdLike: ...


def caller_of(context: CallerContext | None) -> str:
    if context is None or context.remote_id is None:
        return ANONYMOUS
    return context.remote_id.to_base58()


class Quota:
    """Units (sessions, queued requests, ...) held per caller, capped per caller and in total."""

    def __init__(self, what: str, per_caller: int, total: int, flags: tuple[str, str]) -> None:
        self.what = what  # e.g. "open sessions"
        self.per_caller, self.total = per_caller, total
        self.flags = flags  # the options that set the two caps, named in the error so an operator knows what to raise
        self.held: Counter[str] = Counter()

    @property
    def used(self) -> int:
        return self.held.total()

    def acquire(self, caller: str, n: int = 1) -> None:
        if self.held[caller] + n > self.per_caller:
            raise BusyError(
                f"{self.what}: this caller holds {self.held[caller]} of its limit of {self.per_caller} here "
                f"({self.flags[0]}); wait for some to finish or use another server"
            )
        if self.used + n > self.total:
            raise BusyError(
                f"{self.what}: this server is at its limit of {self.total} for all callers ({self.flags[1]}); "
                "try another server or again later"
            )
        self.held[caller] += n

    def release(self, caller: str, n: int = 1) -> None:
        self.held[caller] -= n
        if self.held[caller] <= 0:
            del self.held[caller]  # a caller holding nothing costs no memory


class StreamIdle(Exception):
    """No message began within the idle timeout (not a SwarmError: the handler decides what the caller hears)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"idle for {seconds:g} s")
        self.seconds = seconds


class StreamStalled(Exception):
    """A message began but did not complete within the read timeout (a slow-loris sender)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"a message did not complete within {seconds:g} s of its first frame")
        self.seconds = seconds


class GuardedFrames:
    """The incoming frames of one stream, with a time limit on each wait. Between messages (``decoder`` holds no
    partial message) the wait is ``idle``; once a message's first frame arrived, the rest of that message must come
    within ``read`` of it. The decoder is the one the handler feeds, which is how this knows where messages end."""

    def __init__(self, frames: AsyncIterator[wire.Frame], decoder: wire.Decoder, idle: float, read: float) -> None:
        self._frames = frames
        self.decoder = decoder
        self.idle, self.read = idle, read
        self._started: float | None = None  # when the first frame of the message being read arrived

    def __aiter__(self) -> GuardedFrames:
        return self

    async def __anext__(self) -> wire.Frame:
        loop = asyncio.get_running_loop()
        stalled = self.decoder.in_progress and self._started is not None
        if stalled:
            assert self._started is not None
            timeout = self._started + self.read - loop.time()
        else:
            self._started = None
            timeout = self.idle
        try:
            async with asyncio.timeout(max(timeout, 0.0)):  # no task per frame, unlike wait_for: a decode step's cost
                frame = await anext(self._frames)
        except TimeoutError:
            # built here, never held in a local: an exception in this frame's locals, whose traceback holds the
            # frame, would be a reference cycle keeping the decoder's partial message alive until a full gc
            raise (StreamStalled(self.read) if stalled else StreamIdle(self.idle)) from None
        if self._started is None:
            self._started = loop.time()
        return frame
