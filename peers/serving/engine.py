"""The server's engine room: one object, built once per peer, whose narrow ports the session table, the pass service,
the inference loop and the step pusher are handed (never one another's):

- ``loaded``: the span runtime this peer has loaded and whether it serves it (``Loaded``; the node swaps it);
- ``adapters``: clients' adapters bound to requests and sessions (``ClientAdapters``);
- ``scheduler``: what runs next on the single compute thread (``peers.serving.scheduler``);
- ``queued``: the requests waiting for or running on it, capped per caller and in total (``Quota``);
- ``limits``: the shapes a request may have (``Limits``); ``metrics``: what it counts as it serves (``PeerMetrics``).

The compute thread is one thread: a device runs one kernel stream anyway, and torch releases the GIL so the RPC loop
stays live. Requests waiting for or running on it are capped, so a flood is refused at once instead of queueing
without bound."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from peers.serving.adapters import Adapter, AdapterCache, Pin, parse_adapter
from peers.serving.checks import Limits, check_sub
from peers.serving.config import ComputeConfig
from peers.serving.counters import PeerMetrics
from peers.serving.limits import Quota
from peers.serving.ports import Learner, Tensors
from peers.serving.runtime import SpanRuntime, require
from peers.serving.scheduler import StepScheduler
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.protocol import AdapterRef
from swarm.records import Capability
from swarm.tuning import is_adapter_name

log = logging.getLogger(__name__)
T = TypeVar("T")


class Loaded:
    """The span runtime this peer has loaded, its learner where the span's weights learn, and whether it serves
    requests (a standby holds weights but takes none). The node swaps it when the broker moves the peer: sessions on
    blocks the new span lacks end at their next step."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runtime: SpanRuntime | None = None
        self.learner: Learner | None = None
        self.serving = False

    def set(self, runtime: SpanRuntime, learner: Learner | None = None) -> None:
        self.runtime, self.learner = runtime, learner

    @property
    def held(self) -> Span | None:
        """The blocks this peer serves requests for now (None while joining or standby)."""
        return self.runtime.span if self.runtime is not None and self.serving else None

    def current(self) -> SpanRuntime:
        """The runtime, once a request was let in (``serve``): one is loaded from then on."""
        assert self.runtime is not None
        return self.runtime

    def serve(self, start: int, end: int, capability: Capability, what: str) -> tuple[Span, SpanRuntime]:
        """Blocks ``start:end`` of a request for ``what``, which this peer must serve now with ``capability``."""
        sub = check_sub(self.held, start, end, self.num_blocks)
        runtime = self.current()
        require(runtime, capability, what)
        return sub, runtime


class ClientAdapters:
    """Clients' adapters (LoRA, prompts): the tensors a request carries, parsed against the loaded runtime's layers and
    cached for this caller and client, or the cached version; pinned until the holder (request, session or kept
    graph) releases the pin."""

    def __init__(self, cache: AdapterCache, loaded: Loaded, limits: Limits, served: Counter[str]) -> None:
        self.cache, self.loaded, self.limits, self.served = cache, loaded, limits, served

    def bind(
        self, caller: str, ref: AdapterRef | None, tensors: Tensors, sub: Span
    ) -> tuple[Adapter | None, Pin | None]:
        if ref is None:
            if any(is_adapter_name(name) for name in tensors):
                raise BadInputError("request carries adapter tensors but no adapter reference")
            return None, None
        runtime = self.loaded.current()
        require(runtime, Capability.ADAPTERS, "a request with an adapter (LoRA or prompts)")
        if not ref.has_tensors:
            return self.cache.get(caller, ref, sub)
        limits = self.limits
        adapter = parse_adapter(tensors, sub, runtime.linears, limits.hidden_size, limits.dtype, ref.scaling)
        bound = self.cache.put(caller, ref, adapter, sub)
        self.served["adapter_uploads"] += 1
        return bound

    def drop(self, caller: str, client: str) -> None:
        """The client is done: drop its cached adapter now rather than at the idle timeout (only the caller's own:
        another server on the route knows the client's token, not its identity)."""
        self.cache.drop(caller, client)


class Engine:
    """The server's engine room (see the module's doc)."""

    def __init__(self, limits: Limits, cfg: ComputeConfig, timing: Timing) -> None:
        self.limits = limits
        self.loaded = Loaded(limits.num_blocks)
        self.metrics = PeerMetrics()  # requests by kind and outcome, latency, bytes (``--metrics-port``)
        cache = AdapterCache(cfg.max_adapter_bytes, timing.adapter_ttl, per_caller=cfg.max_caller_adapter_bytes)
        self.adapters = ClientAdapters(cache, self.loaded, limits, self.metrics.served)
        flags = ("--max-caller-queued", "--max-queued")
        self.queued = Quota("queued compute requests", cfg.max_caller_queued, cfg.max_queued, flags)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self._tasks: set[asyncio.Task[object]] = set()
        # what runs next on the compute thread: inference steps batched across sessions, fairly, ahead of other work
        self.scheduler = StepScheduler(
            self._on_thread,
            max(1, cfg.max_batch),
            cfg.max_batch_tokens,
            timing.max_step_wait,
            cfg.inline_tokens,
            self.metrics.batch_rows.observe,
            # a batched layer's room, rows x (longest past + new tokens): eight requests' worth of tokens
            max_room=8 * cfg.max_batch_tokens,
            window=cfg.batch_window_ms / 1000,
        )

    def close(self) -> None:
        self.scheduler.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _on_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, fn: Callable[..., T], *args: object, small: bool = False, caller: str | None = None) -> T:
        """``fn`` on the compute thread, when the scheduler lets it in (after waiting inference steps); a small
        request (a few tokens) inline, where two thread hand-offs would cost more than the compute. A caller's
        request counts toward the queue caps until it is done (``caller`` None: the server's own work, such as a
        trainable stage's catch-up, which no client can multiply)."""
        if caller is not None:
            self.queued.acquire(caller)
        try:
            if small:
                return fn(*args)
            return await self.scheduler.other(fn, *args)
        finally:
            if caller is not None:
                self.queued.release(caller)

    def in_background(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn`` on the compute thread without anyone waiting for it; its failure is logged."""

        def done(task: asyncio.Task[object]) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("background %s failed: %s", getattr(fn, "__name__", fn), task.exception())

        task: asyncio.Task[object] = asyncio.ensure_future(self.run(fn, *args))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(done)
