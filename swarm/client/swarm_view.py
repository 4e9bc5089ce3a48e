"""The client's view of the swarm: DHT records read at most every ``view_refresh`` seconds (or at once after
``invalidate``), peers it banned after failures, latencies it observed, and single routes over what remains.

Waiting for missing blocks and failing over belong to the retry helper (``swarm.client.retry``): a route that
cannot be found raises ``MissingBlocksError`` at once."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator

from swarm.client.routing import Mode, choose_route, eligible, pick_fingerprint
from swarm.config import ClientConfig
from swarm.dht import RecordStore
from swarm.hop import Hop
from swarm.records import Capability, ServerRecord, View

log = logging.getLogger(__name__)


class SwarmView:
    def __init__(
        self,
        store: RecordStore,
        model_id: str,
        num_blocks: int,
        cfg: ClientConfig,
        fingerprints: frozenset[str] | None = None,
    ) -> None:
        self.store = store
        self.model_id = model_id
        self.num_blocks = num_blocks
        self.cfg = cfg
        self.fingerprints = fingerprints  # the weights this client accepts (None: any)
        self._lock = threading.Lock()
        self._view: View = {}
        self._read_at = -float("inf")
        self._banned: dict[str, float] = {}  # peer -> banned until (monotonic)
        # (peer, mode) -> measured seconds per block and step (inference) or token (forward), network included
        self.speeds: dict[tuple[str, Mode], float] = {}
        # peer -> measured round trip (s): routing prices a measured peer's hop by it (the connection may share its own)
        self.rtt: dict[str, float] = {}
        # Stochastic wiring of training micro-batches: no generator is shared between threads (micro-batches in
        # flight at once would take their draws in whatever order the threads ran), see ``wiring``.
        self._seed = cfg.wiring_seed if cfg.wiring_seed is not None else random.SystemRandom().getrandbits(64)
        self._local = threading.local()

    @property
    def hop_latency(self) -> float:
        return self.cfg.hop_latency_s

    @contextlib.contextmanager
    def wiring(self, key: int) -> Iterator[None]:
        """Stochastic routes this thread draws inside the block (a micro-batch's first route and its repairs) come
        from a generator of their own, seeded by (``wiring_seed``, ``key``): a micro-batch's wiring then depends on
        the seed and the micro-batch, not on which thread ran it or how the threads interleaved."""
        before = getattr(self._local, "rng", None)
        self._local.rng = random.Random(f"{self._seed}/{key}")
        try:
            yield
        finally:
            self._local.rng = before

    def _wiring_rng(self) -> random.Random:
        rng: random.Random | None = getattr(self._local, "rng", None)
        if rng is None:  # a stochastic route outside ``wiring``: this thread's own generator, never another's
            rng = self._local.rng = random.Random(f"{self._seed}/{threading.current_thread().name}")
        return rng

    def snapshot(self) -> View:
        with self._lock:
            if time.monotonic() - self._read_at > self.cfg.timing.view_refresh:
                self._view = self.store.view(self.model_id, self.num_blocks)
                self._read_at = time.monotonic()
            return self._view

    def invalidate(self) -> None:
        """Read the swarm again at the next route (blocks were missing: someone may have taken them since)."""
        with self._lock:
            self._read_at = -float("inf")

    def current_fingerprint(self, view: View) -> str | None:
        """Of the weights this client accepts, those the swarm serves most completely right now."""
        return pick_fingerprint(view, self.fingerprints)

    def ban(self, peer_id: str, seconds: float) -> None:
        log.info("banning peer for %.1f s", seconds, extra={"peer": peer_id})
        self._banned[peer_id] = time.monotonic() + seconds

    def unban(self, peer_id: str) -> None:
        """Lift a ban (one set while a second server judged this peer's claim, which that server confirmed)."""
        self._banned.pop(peer_id, None)

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p for p, until in list(self._banned.items()) if until > now)

    def observe(self, peer_id: str, mode: Mode, elapsed: float, units: int) -> None:
        """Learn a peer's real speed from a call of ``units`` block-steps (inference) or block-tokens (forward):
        from then on routing prices the peer by what it did, not by what it claims, so a peer slower than it
        announces (or lying) is routed around."""
        sample = elapsed / max(units, 1)
        old = self.speeds.get((peer_id, mode))
        weight = self.cfg.latency_smoothing
        self.speeds[(peer_id, mode)] = sample if old is None else (1 - weight) * old + weight * sample

    def measured(self, mode: Mode) -> dict[str, float]:
        return {peer: seconds for (peer, m), seconds in list(self.speeds.items()) if m == mode}

    def estimate(self, hop: Hop, mode: Mode, tokens: int) -> float:
        """Seconds a call of ``tokens`` through ``hop`` should take: measured where known, claimed otherwise."""
        per = self.speeds.get((hop.peer_id, mode))
        if per is not None:
            return per * tokens * len(hop.span)
        return self.hop_latency + (hop.step_seconds if mode == "inference" else hop.token_seconds) * tokens

    def servers(
        self,
        min_cache_tokens: int = 0,
        exclude: frozenset[str] = frozenset(),
        needs: frozenset[Capability] = frozenset(),
    ) -> list[ServerRecord]:
        """The servers a route may use now (``needs``: capabilities their runtime must have)."""
        view = self.snapshot()
        return eligible(
            view,
            fingerprint=self.current_fingerprint(view),
            banned=self.banned() | exclude,
            min_cache_tokens=min_cache_tokens,
            needs=needs,
        )

    def route(
        self,
        start: int,
        end: int,
        *,
        mode: Mode = "inference",
        min_cache_tokens: int = 0,
        exclude: frozenset[str] = frozenset(),
        stochastic: bool = False,
        needs: frozenset[Capability] = frozenset(),
    ) -> list[Hop]:
        """The cheapest route over live, unbanned servers now whose runtime has every capability in ``needs``;
        ``stochastic`` scales each server's cost by an Exp(1) draw (micro-batches wired to replicas in proportion to
        their speed). Raises ``MissingBlocksError``."""
        records = self.servers(min_cache_tokens, exclude, needs)
        noise = None
        if stochastic:
            rng = self._wiring_rng()
            noise = {r.peer_id: rng.expovariate(1.0) for r in records}
        return choose_route(
            records,
            start,
            end,
            mode=mode,
            measured=self.measured(mode),
            rtt=dict(self.rtt),
            default_latency=self.hop_latency,
            model_id=self.model_id,
            noise=noise,
        )
