"""What runs next on a server's compute thread: inference steps of different sessions batched into one forward,
fair shares per caller, a bounded wait for every step, and inference ahead of other work.

``pick`` is pure (the waiting steps and the callers' shares in, the next batch out). The step that leads the batch is
the oldest of the caller that has had the fewest tokens computed (start-time fair queueing by authenticated peer id,
so a client with 30 sessions gets the same share of a saturated server as a client with one that asks as much), and
the batch is filled, in the same order, with steps that can share its forward (the same blocks and tokens per row).
That is also the starvation bound: a waiting caller's virtual time stays while the others' grows, so it leads within
a few forwards, and its oldest step (a prompt chunk, a step too long to share a batch) leads for it. Steps that had
waited ``max_wait`` used to go first, oldest first across callers; on a saturated server every step has, which made
it first come first served: a real-process drill (``scripts/bench_fairness.py``) gave the caller with one session
0.13 of the tokens computed instead of half. ``StepScheduler`` is its loop: it runs each batch through the
runtime's ``run_batch`` on the compute thread, while the RPC loop keeps reading the steps that will make up the next
batch (continuous batching: a session joins or leaves between two forwards and never waits for another to finish).

Other compute (forwards and backwards of fine-tuning and training) goes through the same gate: it runs when no
inference step waits, or once it has waited ``max_wait``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from peers.serving.rhythm import Rhythm, hold
from peers.serving.runtime import Batcher, Row
from swarm.ids import Span

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Waiting:
    """One session's step waiting to run: ``row`` through ``sub`` (``alone`` runs it by itself); steps with equal
    ``key`` can share a forward through ``runtime`` (None: it runs alone)."""

    caller: str
    sub: Span
    row: Row
    key: Hashable | None
    since: float
    alone: Callable[[], torch.Tensor] = field(repr=False)
    runtime: Batcher | None = field(repr=False)
    future: asyncio.Future[torch.Tensor] = field(repr=False)
    session: Hashable = None

    @property
    def tokens(self) -> int:
        return int(self.row.hidden.shape[0] * self.row.hidden.shape[1])


@dataclass
class Shares:
    """Tokens computed per caller, in virtual time: a caller that starts waiting is lifted to the least-served waiting
    caller's time, so an idle spell banks no credit. Callers that wait no more are forgotten once they are behind."""

    vtime: dict[str, float] = field(default_factory=dict)
    waiting: frozenset[str] = frozenset()
    floor: float = 0.0

    def order(self, callers: set[str]) -> None:
        for caller in callers - self.waiting:
            self.vtime[caller] = max(self.vtime.get(caller, 0.0), self.floor)
        self.waiting = frozenset(callers)
        if callers:
            self.floor = min(self.vtime[c] for c in callers)
        for caller in [c for c, v in self.vtime.items() if c not in callers and v <= self.floor]:
            del self.vtime[caller]

    def charge(self, caller: str, tokens: int) -> None:
        self.vtime[caller] = self.vtime.get(caller, self.floor) + tokens


def pick(
    waiting: Sequence[Waiting],
    shares: Shares,
    max_rows: int,
    max_tokens: int,
    max_room: int | None = None,
) -> list[Waiting]:
    """The steps to run next, as one batch (see the module's doc); ``shares`` is charged for them. A batch holds at
    most ``max_rows`` rows, ``max_tokens`` new tokens and ``max_room`` positions of past in one layer's room (rows x
    the longest past, plus the new tokens: what a batched layer gathers, ``peers.blocks.batched``)."""
    shares.order({w.caller for w in waiting})

    def fairest(steps: Sequence[Waiting]) -> Waiting:
        return min(steps, key=lambda w: (shares.vtime.get(w.caller, shares.floor), w.since))

    first = fairest(waiting)
    batch: list[Waiting] = [first]
    rows, tokens, top = first.row.rows, first.tokens, first.row.past
    n = int(first.row.hidden.shape[1])
    shares.charge(first.caller, first.tokens)
    if first.key is None:
        return batch
    rest = [w for w in waiting if w is not first and w.key == first.key]
    while rest:
        nxt = fairest(rest)
        rest.remove(nxt)
        room = (rows + nxt.row.rows) * (max(top, nxt.row.past) + n)
        if rows + nxt.row.rows > max_rows or tokens + nxt.tokens > max_tokens or room > (max_room or room):
            continue  # a smaller one may still fit
        batch.append(nxt)
        rows, tokens, top = rows + nxt.row.rows, tokens + nxt.tokens, max(top, nxt.row.past)
        shares.charge(nxt.caller, nxt.tokens)
    return batch


def batching(runtime: object, sub: Span, row: Row, prompts: int) -> tuple[Batcher | None, Hashable | None]:
    """Whether a session's step may share a forward, and with which steps: only through a runtime that batches
    (``Batcher``), when the session's cache has a layout a batch reproduces exactly and no deep prompt is still to be
    added (``prompts``: the adapter's prompt tokens, added at the first positions); then with the steps through the
    same blocks with as many tokens per row. ``(None, None)``: it runs alone."""
    if not isinstance(runtime, Batcher) or not runtime.joins(row.cache) or row.past < prompts:
        return None, None
    return runtime, (sub, int(row.hidden.shape[1]))


def pieces(runtime: object, n: int, past: int, chunk: int, prompts: int) -> list[tuple[int, int]]:
    """A step of ``n`` tokens after ``past`` as the turns it takes on the compute thread: a long one (a prompt) in
    pieces of ``chunk`` tokens, so other sessions' next tokens are not held up by it (chunked prefill), but a deep
    prompt (``prompts`` tokens, at the start) in one piece. Only a runtime that batches splits a step."""
    size = max(chunk, prompts if past == 0 else 0)
    if not isinstance(runtime, Batcher) or n <= size:
        return [(0, n)]
    return [(at, min(n, at + size)) for at in range(0, n, size)]


class StepScheduler:
    """The server's compute gate and inference batcher (see the module's doc)."""

    def __init__(
        self,
        run_on_thread: Callable[..., Any],
        max_rows: int,
        max_tokens: int,
        max_wait: float,
        inline_tokens: int,
        observe: Callable[[int], None],
        max_room: int | None = None,
        window: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._thread = run_on_thread  # (fn, *args) -> awaitable: fn on the compute thread
        self.max_rows, self.max_tokens, self.max_wait, self.max_room = max_rows, max_tokens, max_wait, max_room
        self.window = window  # how long a step that wakes an idle scheduler waits for companions
        self.inline_tokens = inline_tokens
        self._observe = observe  # rows of each forward run (the batch-size metric)
        self.clock = clock
        self.shares = Shares()
        self.rhythm = Rhythm()
        self.waiting: list[Waiting] = []
        self._others: list[tuple[float, asyncio.Future[None]]] = []  # other work waiting for the thread
        self._busy = False  # the compute thread runs something of ours
        self._batching = False  # ...and it is inference steps (a small step then waits to join the next batch)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def step(
        self,
        caller: str,
        sub: Span,
        row: Row,
        alone: Callable[[], torch.Tensor],
        runtime: Batcher | None = None,
        key: Hashable | None = None,
        lone: bool = False,
        session: Hashable = None,
    ) -> torch.Tensor:
        """``row``'s output: run at once on this loop when it is small (a thread hand-off would cost more than the
        compute), its session is the only one open (``lone``) and no step waits or runs; else in the next batch its
        ``key`` allows. With several sessions open, steps go to the compute thread even when they arrive one by one:
        while one runs there, the loop reads the others, which then run together (run inline, each would block the
        loop and the next would find nothing waiting, so nothing would ever batch)."""
        tokens = int(row.hidden.shape[0] * row.hidden.shape[1])
        if session is not None:
            self.rhythm.arrived(session, self.clock(), row.rows)
        # unbatched (``--max-batch 1``), every small step runs inline as before batching existed
        alone_anyway = lone or self.max_rows == 1
        if alone_anyway and not self._batching and not self.waiting and tokens <= self.inline_tokens:
            self._observe(row.rows)
            return alone()
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self.waiting.append(Waiting(caller, sub, row, key, self.clock(), alone, runtime, future, session))
        self._start()
        try:
            return await future
        finally:
            if not future.done():  # the caller went away: it runs no more (unless its batch already started)
                self.waiting = [w for w in self.waiting if w.future is not future]

    async def other(self, fn: Callable[..., T], *args: object) -> T:
        """``fn`` on the compute thread, after waiting inference steps (or once it has waited ``max_wait``)."""
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._others.append((self.clock(), gate))
        self._start()
        try:
            await gate
        except BaseException:
            self._others = [o for o in self._others if o[1] is not gate]
            if gate.done() and not gate.cancelled():
                self._release()  # it was let in: let the next in
            raise
        try:
            result: T = await self._thread(fn, *args)
            return result
        finally:
            self._release()

    def _release(self) -> None:
        self._busy = False
        self._wake.set()

    def _start(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.window > 0 and self.waiting and not self._busy:
                # Woken from idle by a step: its companions (the rest of a client's round, a burst pushed by the
                # previous hop's batch) are usually a few hundred microseconds behind it. Without this wait the first
                # would run alone and the rest in the next batch: twice the forwards for the same rows.
                await asyncio.sleep(self.window)
            while not self._busy and (self.waiting or self._others):
                now = self.clock()
                rows = self.rhythm.cohort(now, self.max_rows)
                wait = 0.0 if self._others else hold(self.waiting, self.rhythm, now, rows, self.max_wait)
                if wait > 0:  # companions are due: a step that arrives wakes the loop, which looks again
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    continue
                if self._others and (not self.waiting or now - self._others[0][0] >= self.max_wait):
                    _, gate = self._others.pop(0)
                    if not gate.done():
                        self._busy = True  # until ``other`` releases it
                        gate.set_result(None)
                    continue
                batch = pick(self.waiting, self.shares, rows, self.max_tokens, self.max_room)
                self.waiting = [w for w in self.waiting if w not in batch]
                self._busy = self._batching = True
                try:
                    await self._run(batch)
                finally:
                    self._busy = self._batching = False

    async def _run(self, batch: list[Waiting]) -> None:
        live = [w for w in batch if not w.future.done()]
        if not live:
            return
        self._observe(sum(w.row.rows for w in live))
        try:
            outs, seconds, cpu = await self._thread(_run_batch, live)
            self.rhythm.ran(seconds, [w.session for w in live], cpu, self.clock())
        except Exception as e:
            if len(live) == 1:
                live[0].future.set_exception(e)
                return
            # A batch failed: each row again alone, so only the row at fault hears the error (caches are untouched
            # by a failed batch: rows' own caches get their new tokens only after the forward).
            log.warning("a batch of %d failed (%s); its rows run alone", len(live), e)
            for w in live:
                await self._run([w])
            return
        for w, out in zip(live, outs, strict=True):
            if not w.future.done():
                w.future.set_result(out)


def _run_batch(batch: list[Waiting]) -> tuple[list[torch.Tensor], float, float | None]:
    """The batch's outputs, the seconds it took and, on the CPU, the seconds of CPU the compute thread got meanwhile
    (measured here, on the thread: the hand-off to it is not the device's doing)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    outs = _forward(batch)
    on_cpu = batch[0].row.hidden.device.type == "cpu"
    return outs, time.perf_counter() - wall, time.thread_time() - cpu if on_cpu else None


def _forward(batch: list[Waiting]) -> list[torch.Tensor]:
    """On the compute thread: one step alone, or one forward of every row (``pick`` batches only equal keys, which
    only steps with a runtime that batches have)."""
    if len(batch) == 1:
        return [batch[0].alone()]
    runtime = batch[0].runtime
    assert runtime is not None
    with torch.inference_mode():
        return list(runtime.run_batch([w.row for w in batch], batch[0].sub))
