"""The API process's parts, wired: a swarm client and tokenizer per served model, the request state (limits, keys,
metrics), the dashboard's observers, and a watcher that turns the clients' failovers into metrics and dashboard
events. ``python -m swarm.api`` starts one; tests can too."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from swarm.api.app import create_app
from swarm.api.conversations import Conversations
from swarm.api.engine import ServedModel
from swarm.api.limits import Limits
from swarm.api.runs import ApiState
from swarm.client.speculative.loop import Speculation
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.metrics import ApiMetrics

if TYPE_CHECKING:
    from fastapi import FastAPI

    from swarm.api.config import ApiConfig
    from swarm.client.model import DistributedModelForCausalLM

log = logging.getLogger(__name__)


def _traffic(models: dict[str, ServedModel]) -> dict[str, int]:
    """Bytes the API's swarm clients sent and received, all models together (read when metrics are scraped)."""
    total: Counter[str] = Counter()
    for served in models.values():
        total.update(served.model.connection.remote.traffic)
    return dict(total)


def kept_room(model: DistributedModelForCausalLM) -> int:
    """Tokens of KV room the sessions kept for callers' next turns may hold: a quarter of the smallest budget a
    server of the swarm announces (half the share one caller, this API, has there by default)."""
    totals = [r.cache_tokens_total for r in model.connection.view.servers() if r.cache_tokens_total > 0]
    return min(totals, default=0) // 4


class Service:
    def __init__(self, models: dict[str, ServedModel], state: ApiState) -> None:
        self.models, self.state = models, state
        self._failures: dict[str, dict[str, int]] = {name: {} for name in models}
        self._closers: list[Callable[[], None]] = []
        self.on_failover: list[Callable[[str, str, int], None]] = []  # (model, peer id, failures of that peer)

    @classmethod
    def start(cls, cfg: ApiConfig, limits: Limits, keys: tuple[str, ...], test_timings: bool = False) -> Service:
        import torch

        from swarm.client.model import DistributedModelForCausalLM
        from swarm.tokenizer import load_tokenizer

        torch.set_num_threads(cfg.threads)
        timing = Timing.for_tests() if test_timings else Timing()
        models: dict[str, ServedModel] = {}
        try:
            for name in cfg.models:
                try:
                    tokenizer = load_tokenizer(name)
                except (OSError, ValueError) as e:
                    raise BadInputError(f"{name} has no tokenizer, so the API cannot serve it: {e}") from None
                model = DistributedModelForCausalLM.from_pretrained(
                    name,
                    initial_peers=cfg.initial_peers,
                    timing=timing,
                    swarm_key=cfg.swarm_key,
                    codec=cfg.codec,
                    local_blocks=cfg.local_blocks,
                    trusted_peers=cfg.trusted_peers,
                    allow_quantized=cfg.allow_quantized,
                    prefix_cache=cfg.prefix_cache,
                    share_prefixes=cfg.share_prefixes,
                )
                spec = Speculation(cfg.draft, max_k=cfg.draft_max) if cfg.draft else None
                try:
                    # a kept session is closed before the servers' own idle limit would end it
                    kept = Conversations(
                        cfg.keep_sessions,
                        idle=min(cfg.keep_idle, timing.session_idle / 2),
                        room=functools.partial(kept_room, model),
                    )
                    served = ServedModel(name, model, tokenizer, cfg.max_context, spec, kept)
                except BaseException:
                    model.close()
                    raise
                models[served.name] = served
                log.info("serving %s (%d blocks, context %d)", name, served.num_blocks, served.context)
        except BaseException:
            for served in models.values():
                served.model.close()
            raise
        metrics = ApiMetrics(traffic=lambda: _traffic(models))
        service = cls(models, ApiState(models, limits, keys, metrics))
        service.on_failover.append(lambda model, peer, n: metrics.failover())
        return service

    def app(self, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None) -> FastAPI:
        return create_app(self.state, lifespan)

    def attach_dashboard(self, app: FastAPI, stopping: Callable[[], bool]) -> None:
        """The web dashboard and chat page (``swarm.dashboard``) on ``app``: an observer of each served model's swarm
        on its client's loop, noting the clients' failovers; ``stopping``: true once the server shuts down."""
        from swarm.dashboard.attach import observe_connections
        from swarm.dashboard.routes import dashboard_router

        observers, stop = observe_connections({n: (s.model.connection, s.num_blocks) for n, s in self.models.items()})
        self._closers.append(stop)
        self.on_failover.append(
            lambda model, peer, n: observers[model].note("failover", peer, f"a client failed over from it ({n})")
        )
        app.include_router(dashboard_router(observers, chat=True, stopping=stopping, access=self.state.access))

    def poll_failovers(self) -> None:
        """Report peers the clients banned since the last poll (their failure counts grew)."""
        for name, served in self.models.items():
            now = dict(served.model.connection.retrier.failures)
            seen = self._failures[name]
            for peer, n in now.items():
                if n > seen.get(peer, 0):
                    log.warning("client failed over from a peer", extra={"peer": peer, "kind": name})
                    for listener in self.on_failover:
                        listener(name, peer, n)
            self._failures[name] = now

    async def watch_failovers(self, period: float = 0.5) -> None:
        """Every ``period``: the clients' failovers reported, and kept sessions past their idle time closed (off the
        event loop: closing one is a call to its servers)."""
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):  # a watcher must never take the API down
                self.poll_failovers()
            for served in self.models.values():
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(served.conversations.expire)

    def close(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        for run in list(self.state.runs):
            run.cancel.set()  # each worker stops before its next token and closes its session
        self.state.pool.shutdown(wait=True, cancel_futures=True)
        for served in self.models.values():
            with contextlib.suppress(Exception):
                served.conversations.close()  # the kept sessions' server caches, freed now
            with contextlib.suppress(Exception):
                served.model.close()
