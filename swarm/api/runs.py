"""The API's state (models, limits, metrics, the worker pool) and its runs: one generation on the worker pool, seen
from the request's coroutine as a stream of pieces, and the responses that stop it however the request ends."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from swarm.api import errors
from swarm.api.engine import Cancelled, Outcome, Piece, Sampling, ServedModel, generate
from swarm.api.limits import Limits, Slots
from swarm.api.replies import now
from swarm.dashboard.access import Access
from swarm.metrics import ApiMetrics

_DONE = object()


@dataclass
class ApiState:
    models: dict[str, ServedModel]
    limits: Limits
    keys: tuple[str, ...] = ()
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    slots: Slots = field(init=False)
    pool: ThreadPoolExecutor = field(init=False)
    started: int = field(default_factory=now)
    runs: set[Run] = field(default_factory=set)  # generations running now (cancelled at shutdown)
    access: Access = field(init=False)
    body_timeout: float = 30.0  # seconds a request's body may take to arrive

    def __post_init__(self) -> None:
        self.access = Access(self.keys)
        self.slots = Slots(self.limits)
        self.pool = ThreadPoolExecutor(self.limits.max_concurrent, thread_name_prefix="api-generate")

    def key_of(self, request: Request) -> str | None:
        """The caller's API key, checked (None when this server needs none)."""
        if self.access.open:
            return None
        key = self.access.header_key(request.headers)  # the header only: a dashboard cookie opens no /v1 route
        if key is None:
            raise errors.unauthorized()
        return key

    def enter(self, caller: str) -> None:
        self.slots.acquire(caller)
        self.metrics.in_flight.inc()

    def leave(self, caller: str) -> None:
        self.metrics.in_flight.dec()
        self.slots.release(caller)

    def served(self, name: str) -> ServedModel:
        if name not in self.models:
            raise errors.unknown_model(name, sorted(self.models))
        return self.models[name]


class Run:
    """One generation on the worker pool, seen from the request's coroutine as a stream of pieces. It holds its
    caller's slot (taken by the caller) until the worker has stopped, however the request ended."""

    def __init__(
        self, state: ApiState, served: ServedModel, prompt: list[int], sampling: Sampling, caller: str
    ) -> None:
        self.cancel = threading.Event()
        self.progress = Outcome(prompt_tokens=len(prompt))  # the worker fills it in as it goes
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + state.limits.request_timeout

        def emit(piece: Piece) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, piece)

        self.future = loop.run_in_executor(
            state.pool, lambda: generate(served, prompt, sampling, emit, self.cancel, deadline, self.progress, caller)
        )
        state.runs.add(self)

        def finished(_: object) -> None:
            self.queue.put_nowait(_DONE)
            state.runs.discard(self)
            state.leave(caller)

        self.future.add_done_callback(finished)

    async def pieces(self) -> AsyncIterator[Piece]:
        while (item := await self.queue.get()) is not _DONE:
            assert isinstance(item, Piece)
            if item.text or item.finish or item.logprobs:
                yield item

    def outcome(self) -> Outcome:
        try:
            return self.future.result()
        except Cancelled as e:
            raise errors.ApiError(
                408,
                f"the request stopped: {e}",
                type="server_error",
                code="timeout",
                outcome="client_closed" if self.cancel.is_set() else "timeout",
            ) from None
        except Exception as e:
            raise errors.from_swarm(e) from None


async def watch_disconnect(request: Request, run: Run) -> None:
    while not run.future.done():
        if await request.is_disconnected():
            run.cancel.set()
            return
        await asyncio.sleep(0.1)


class RunStream(StreamingResponse):
    """A stream that stops its generation however the response ends: also when the connection drops before the
    body's first chunk (the body generator, never started, would run no ``finally``)."""

    def __init__(self, run: Run, content: AsyncIterator[str], media_type: str, headers: Mapping[str, str]) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel.set()
