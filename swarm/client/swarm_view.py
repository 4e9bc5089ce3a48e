"""The client's view of the swarm: DHT records read at most every ``view_refresh`` seconds, peers it banned after
failures, and routes over what remains."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping

from swarm.client.routing import Hop, choose_route, eligible, pick_fingerprint
from swarm.config import Timing
from swarm.dht import read_view
from swarm.errors import MissingBlocksError
from swarm.records import ServerRecord

log = logging.getLogger(__name__)


class SwarmView:
    def __init__(
        self,
        dht,
        model_id: str,
        num_blocks: int,
        timing: Timing,
        fingerprint: str | None = None,
        hop_latency: float = 0.003,
    ) -> None:
        self.dht = dht
        self.model_id = model_id
        self.num_blocks = num_blocks
        self.timing = timing
        self.fingerprint = fingerprint
        self.hop_latency = hop_latency
        self._lock = threading.Lock()
        self._view: Mapping[int, list[ServerRecord]] = {}
        self._read_at = -float("inf")
        self._banned: dict[str, float] = {}  # peer -> banned until (monotonic)
        self.latency: dict[str, float] = {}  # peer -> observed seconds beyond its announced compute (EWMA)
        self._rng = random.Random()  # stochastic wiring of training micro-batches (routing.choose_route's noise)

    def snapshot(self, force: bool = False) -> Mapping[int, list[ServerRecord]]:
        with self._lock:
            if force or time.monotonic() - self._read_at > self.timing.view_refresh:
                self._view = read_view(self.dht, self.model_id, self.num_blocks)
                self._read_at = time.monotonic()
            return self._view

    def current_fingerprint(self, view: Mapping[int, list[ServerRecord]]) -> str | None:
        """The user's choice, else whatever weights the swarm serves most completely right now."""
        return self.fingerprint or pick_fingerprint(view, self.num_blocks)

    def ban(self, peer_id: str, seconds: float) -> None:
        log.info("banning peer for %.1f s", seconds, extra={"peer": peer_id})
        self._banned[peer_id] = time.monotonic() + seconds

    def observe(self, peer_id: str, elapsed: float, expected: float) -> None:
        """Learn how much slower than announced a peer really is; routing adds it to the peer's hop cost, so a
        peer that is alive but slow is routed around."""
        excess = max(elapsed - expected, 0.0)
        old = self.latency.get(peer_id)
        self.latency[peer_id] = excess if old is None else 0.7 * old + 0.3 * excess

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p for p, until in self._banned.items() if until > now)

    def route(
        self,
        start: int,
        end: int,
        *,
        mode: str = "inference",
        min_cache_tokens: int = 0,
        exclude: frozenset[str] = frozenset(),
        wait: bool = True,
        stochastic: bool = False,
    ) -> list[Hop]:
        """A route over live, unbanned peers; waits up to ``missing_blocks_wait`` for missing blocks to appear
        (at once with ``wait=False``)."""
        deadline = time.monotonic() + (self.timing.missing_blocks_wait if wait else 0.0)
        force = False
        while True:
            view = self.snapshot(force=force)
            records = eligible(
                view,
                fingerprint=self.current_fingerprint(view),
                banned=self.banned() | exclude,
                min_cache_tokens=min_cache_tokens,
            )
            try:
                return choose_route(
                    records,
                    start,
                    end,
                    mode=mode,
                    latency=self.latency,
                    default_latency=self.hop_latency,
                    model_id=self.model_id,
                    noise={r.peer_id: self._rng.expovariate(1.0) for r in records} if stochastic else None,
                )
            except MissingBlocksError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(min(self.timing.view_refresh, max(deadline - time.monotonic(), 0.0)))
            force = True
