"""The client's view of the swarm: DHT records read at most every ``view_refresh`` seconds (or at once after
``invalidate``), peers it banned after failures, latencies it observed, and single routes over what remains.

Waiting for missing blocks and failing over belong to the retry helper (``swarm.client.retry``): a route that
cannot be found raises ``MissingBlocksError`` at once.

Privacy (``ClientConfig``): blocks below ``local_blocks`` run on the client, so no route ever covers them (every route,
a session's and a repair's included, is asked of ``route``); with ``trusted_peers``, only those peers exist for the
client: a block none of them serves is missing, never routed to someone else."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping

from swarm.client.routing import Mode, choose_route, eligible, pick_fingerprint
from swarm.codecs import choose_codec, parse_codec
from swarm.config import ClientConfig
from swarm.dht import RecordStore
from swarm.errors import MissingBlocksError, SwarmError
from swarm.hop import Hop
from swarm.ids import shard_of
from swarm.perf.calibration import CODEC_BYTES
from swarm.perf.model import Software
from swarm.perf.placement import RouteCosts
from swarm.records import Capability, PeerState, ServerRecord, View

log = logging.getLogger(__name__)
ROUTE_SAMPLE = 8  # online servers per block a client reads before routing (all of a swarm with fewer)

SLOW_LOAD = 16.0  # a new session prices a server that was slow but alive (``slow``) at this many times its load
MAX_PATIENCE = 8.0  # ...and waits at most this many times the usual deadline for its steps


class SwarmView:
    def __init__(
        self,
        store: RecordStore,
        model_id: str,
        num_blocks: int,
        cfg: ClientConfig,
        fingerprints: frozenset[str] | None = None,
        *,
        groups: Mapping[str, str] | None = None,
        value_bytes: int = 0,
        hidden: int = 0,
        software: Software | None = None,
    ) -> None:
        """``hidden`` and ``value_bytes``: the model's hidden size and the bytes of one value of its hidden states
        (0: bytes not priced); ``software``: the swarm's fixed costs from this machine's calibration (None: never
        calibrated, so routing's flat prior stands in)."""
        self.store = store
        self.model_id = model_id
        self.num_blocks = num_blocks
        self.cfg = cfg
        self.fingerprints = fingerprints  # the weights this client accepts (None: any)
        self.groups = dict(
            groups or {}
        )  # fingerprint -> group: those that may share a chain (routing.pick_fingerprint)
        self._lock = threading.Lock()
        self._view: View = {}
        self._read_at = -float("inf")
        self._banned: dict[str, float] = {}  # peer -> banned until (monotonic)
        self._for_cause: set[str] = set()  # peers banned for wrong answers or convicted: never paroled
        self._slow: dict[str, tuple[float, int]] = {}  # peer -> (avoided until, times): missed deadlines, alive
        self._disputed: dict[str, float] = {}  # peer -> avoided until: in a verification dispute nothing decided
        self.sessions_here: Counter[str] = Counter()  # peer -> this client's inference sessions open on it
        # (peer, mode) -> measured seconds per block and step (inference) or token (forward), network included
        self.speeds: dict[tuple[str, Mode], float] = {}
        # peer -> measured round trip (s): routing prices a measured peer's hop by it (the connection may share its own)
        self.rtt: dict[str, float] = {}
        # Stochastic wiring of training micro-batches: no generator is shared between threads (micro-batches in
        # flight at once would take their draws in whatever order the threads ran), see ``wiring``.
        self._seed = cfg.wiring_seed if cfg.wiring_seed is not None else random.SystemRandom().getrandbits(64)
        self._local = threading.local()
        self.value_bytes, self.hidden = value_bytes, hidden
        self.software = software or Software()
        self._forced = parse_codec(cfg.codec)

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

    def wire(self, nbytes: float, mbps: float | None) -> float:
        """Bytes on the wire for ``nbytes`` of hidden states over a link of ``mbps``: the codec the transport picks
        (``swarm.codecs.choose_codec``, on the link's announced rate), never more than the tensor itself."""
        codec = choose_codec(int(nbytes), mbps, forced=self._forced)
        per_value = min(CODEC_BYTES.get(codec.value, self.value_bytes), self.value_bytes)
        return nbytes * per_value / self.value_bytes

    def costs(self, mode: Mode, tokens: int = 1) -> RouteCosts:
        """What a hop costs beyond its compute, as the performance model prices it for a call of ``tokens``
        tokens: an inference step chained or client-mediated as this client sends them (``ClientConfig.chain``), a
        forward always client-mediated; the calibrated software cost per hop of such a call; the hidden states'
        bytes through the codec; the flat ``hop_latency_s`` for a hop whose round trip was never measured."""
        sw = self.software
        chained = mode == "inference" and self.cfg.chain
        per_hop = (sw.step_hop_chained if chained else sw.step_hop) if mode == "inference" else sw.call_hop
        return RouteCosts.from_prior(
            self.hop_latency,
            software=per_hop,
            token_bytes=float(self.hidden * self.value_bytes),
            tokens=max(tokens, 1),
            chained=chained,
            wire=self.wire if self.value_bytes else None,
        )

    def snapshot(self) -> View:
        with self._lock:
            if time.monotonic() - self._read_at > self.cfg.timing.view_refresh:
                # a sample of a large swarm: enough servers of every block to route over (``RecordStore.view``)
                self._view = self.store.view(self.model_id, self.num_blocks, enough=ROUTE_SAMPLE)
                self._read_at = time.monotonic()
            return self._view

    def invalidate(self) -> None:
        """Read the swarm again at the next route (blocks were missing: someone may have taken them since)."""
        with self._lock:
            self._read_at = -float("inf")

    def current_fingerprint(self, view: View) -> frozenset[str] | None:
        """Of the weights this client accepts, those the swarm serves most completely right now (with the formats
        of the same weights it allowed: they chain together)."""
        return pick_fingerprint(view, self.fingerprints, self.groups)

    def ban(self, peer_id: str, seconds: float, for_cause: bool = False) -> None:
        """Route around ``peer_id`` for ``seconds``. ``for_cause``: it was caught computing wrong answers or convicted
        by an accusation, never paroled; a peer banned for failing (an error, a timeout) may be (``parole``)."""
        log.info("banning peer for %.1f s", seconds, extra={"peer": peer_id, "for_cause": for_cause})
        until = time.monotonic() + seconds
        if for_cause:
            self._for_cause.add(peer_id)
        elif peer_id in self._for_cause:  # a failure's shorter ban does not cut a ban for cause short
            until = max(until, self._banned.get(peer_id, 0.0))
        # otherwise the latest ban stands, shorter too: a stage set aside briefly while a second server judges its
        # refusal must come back soon (it then hears of the trainers' steps again: ``Procedures.notify_step``)
        self._banned[peer_id] = until

    def parole(self) -> frozenset[str]:
        """Lift the bans of the peers banned only for failing, and say whose: a call that would fail for blocks
        nobody else serves tries them again first (a busy or briefly unreachable server is not a missing one)."""
        lifted = self.banned() - self._for_cause
        for peer_id in lifted:
            self._banned.pop(peer_id, None)
        if lifted:
            log.info("paroling %d banned peer(s) before blocks count as missing", len(lifted))
        return lifted

    def slow(self, peer_id: str, seconds: float) -> None:
        """``peer_id`` missed a step's deadline but answered its liveness check: busy, not dead. Never banned for it:
        new sessions price it ``SLOW_LOAD`` times dearer for ``seconds`` (they go elsewhere when anyone else serves
        its blocks), and its steps get longer deadlines (``patience``) when it is the one left."""
        self._slow[peer_id] = (time.monotonic() + seconds, self._slow.get(peer_id, (0.0, 0))[1] + 1)

    def busy(self, peer_id: str, seconds: float) -> None:
        """``peer_id`` refused a call at one of its limits (``BusyError``): set aside as ``slow`` is for ``seconds``,
        its steps' deadlines unchanged (it answered at once)."""
        until, times = self._slow.get(peer_id, (0.0, 0))
        self._slow[peer_id] = (max(until, time.monotonic() + seconds), times)

    def listed(self, peer_id: str, block: int) -> bool:
        """Whether ``peer_id`` announces a live server record of this model holding ``block`` now, by a thorough read
        of its shard (what a chained server reads to check its next hop). A read that fails says no."""
        try:
            records = self.store.shard(self.model_id, shard_of(peer_id))
        except (SwarmError, TimeoutError, OSError):
            return False
        live = (PeerState.ONLINE, PeerState.LEAVING)
        return any(r.peer_id == peer_id and r.state in live and r.start <= block < r.end for r in records)

    def patience(self, peer_id: str) -> float:
        """How many times the usual deadline a step to ``peer_id`` gets: doubled each time it was found slow but
        alive (at most ``MAX_PATIENCE``), so a busy server that alone serves some blocks is waited for, not lost."""
        times = self._slow.get(peer_id, (0.0, 0))[1]
        return min(2.0**times, MAX_PATIENCE)

    def slowed(self) -> frozenset[str]:
        """The peers set aside as slow (``slow``) right now."""
        now = time.monotonic()
        return frozenset(p for p, (until, _) in list(self._slow.items()) if until > now)

    def dispute(self, peer_id: str, seconds: float) -> None:
        """``peer_id`` and another server disagreed on the same work and nothing this client could ask decided who
        computed wrong: one of them did, so neither is banned (it may be the honest one) but both are priced
        ``SLOW_LOAD`` times dearer for ``seconds``, so new sessions go to any other server of their blocks (and a
        cheater's inflated speed claim does not win them back)."""
        now = time.monotonic()
        for gone in [p for p, until in self._disputed.items() if until <= now]:  # held only while it counts
            del self._disputed[gone]
        self._disputed[peer_id] = now + seconds

    def disputed(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p for p, until in list(self._disputed.items()) if until > now)

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

    def session_load(self, records: list[ServerRecord]) -> dict[str, float]:
        """Each server's load factor for a new session: 1 + ``session_load_weight`` x the sessions open on it, as it
        announces them or as many as this client holds there, whichever is more (a record is up to a heartbeat old,
        and this client's own sessions of the last seconds are not in it yet); ``SLOW_LOAD`` times that for a server
        found slow but alive lately (``slow``) or in a dispute nothing decided (``dispute``)."""
        weight, slowed = self.cfg.session_load_weight, self.slowed() | self.disputed()
        return {
            r.peer_id: (1.0 + weight * max(r.open_sessions, self.sessions_here[r.peer_id]))
            * (SLOW_LOAD if r.peer_id in slowed else 1.0)
            for r in records
        }

    def observe_rtt(self, peer_id: str, seconds: float) -> None:
        """A round trip to ``peer_id`` measured where a session opens, averaged like speeds (``latency_smoothing``):
        what chained steps' deadlines add, and what routing prices a hop's link at."""
        old = self.rtt.get(peer_id)
        weight = self.cfg.latency_smoothing
        self.rtt[peer_id] = seconds if old is None else (1 - weight) * old + weight * seconds

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
        with_banned: bool = False,
    ) -> list[ServerRecord]:
        """The servers a route may use now (``needs``: capabilities their runtime must have; ``with_banned``: the
        ones this client banned too, for what every server of the swarm should hear)."""
        view = self.snapshot()
        trusted = self.cfg.trusted_peers
        if trusted:  # before the weights are picked too: only the trusted peers' weights can be chosen
            view = {b: [r for r in records if r.peer_id in trusted] for b, records in view.items()}
        return eligible(
            view,
            fingerprint=self.current_fingerprint(view),
            banned=exclude if with_banned else self.banned() | exclude,
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
        tokens: int = 1,
    ) -> list[Hop]:
        """The cheapest route over live, unbanned servers now whose runtime has every capability in ``needs``, for
        calls of ``tokens`` tokens (priced by ``costs``); ``stochastic`` scales each server's cost by an Exp(1) draw
        (micro-batches wired to replicas in proportion to their speed). An inference route (a new session's) prices
        each server's compute by its load (``session_load``). Raises ``MissingBlocksError``. Blocks below
        ``local_blocks`` are the client's own: a route starts after them whatever ``start`` says."""
        start = max(start, self.cfg.local_blocks)
        records = self.servers(min_cache_tokens, exclude, needs)
        noise = None
        if stochastic:
            rng = self._wiring_rng()
            noise = {r.peer_id: rng.expovariate(1.0) for r in records}
        try:
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
                costs=self.costs(mode, tokens),
                load=self.session_load(records) if mode == "inference" else None,
            )
        except MissingBlocksError as e:
            if self.cfg.trusted_peers:  # say why: the blocks may well be served, by peers this client does not trust
                n = len(self.cfg.trusted_peers)
                e.args = (f"{e.args[0]}: none of the {n} trusted peer(s) serves them (trusted_peers)",)
            raise
