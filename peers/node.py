"""One volunteer peer's changing state (``Peer``): the stage it serves, whose span can change, the records it
announces, and what it reports of itself. The node never asks what kind of stage it runs
(``peers.serving.stage_port``), and serves no web app of its own: metrics read its frozen snapshots. ``peers.run``
builds a peer whole, in phases, and runs it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from peers.broker.planner import Role
from peers.config import PeerConfig
from peers.hardware import Hardware, cached_throughput
from peers.metrics import PeerSnapshot
from peers.relay_service import RelayStats
from peers.serving.engine import Engine
from peers.serving.pass_service import PassService
from peers.serving.runtime import SpanRuntime
from peers.serving.sessions import SessionTable
from peers.serving.stage_port import Stage
from swarm.dht import RecordStore, dht_time
from swarm.ids import Span
from swarm.protocol import PROTOCOL_VERSION, InfoReply
from swarm.records import ALL_CAPABILITIES, PeerRecord, PeerState, Reached, ServerRecord
from swarm.version import __version__

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """What serves requests on a peer: the engine room, the session table and the pass service built on it."""

    engine: Engine
    sessions: SessionTable
    passes: PassService


def _none() -> int:
    return 0


@dataclass(frozen=True)
class Reach:
    """Where and how others reach this peer, as its records say: measured when it joins, completed by the roles that
    find the rest out as it starts (the direct plane's port, hole punching, relay slots); a private peer's relayed
    addresses change while it runs."""

    reached: Reached = "unmeasured"
    maddrs: tuple[str, ...] = ()
    direct_address: str | None = None
    punch_via: tuple[str, ...] = ()  # behind a NAT: observers a caller punching through to it asks
    punched: Callable[[], int] = field(default=_none, compare=False)  # behind a NAT: connections punched to it


class Peer:
    """One peer's changing state: the span it holds, what it does with it, and how it tells the swarm."""

    def __init__(
        self,
        cfg: PeerConfig,
        stage: Stage,
        store: RecordStore,
        hardware: Hardware,
        max_blocks: int,
        serving: Serving,
        reach: Reach,
        relay_stats: RelayStats | None = None,
        network_mbps: float | None = None,
    ) -> None:
        """``relay_stats``: what it relayed for others (``--relay``); ``network_mbps``: its link, declared or
        estimated at start."""
        self.cfg, self.stage, self.model, self.store = cfg, stage, stage.model, store
        self.hardware, self.max_blocks, self.serving = hardware, max_blocks, serving
        self.engine, self.sessions, self.passes = serving.engine, serving.sessions, serving.passes
        self.reach, self.relay_stats, self.network_mbps = reach, relay_stats, network_mbps
        self.peer_id = store.peer_id
        self._span: Span | None = None
        self._role: Role | None = None
        self.state = PeerState.JOINING
        self.block_tps = 0.0  # forward tokens/s of one block
        self.block_sps = 0.0  # single-token inference steps/s of one block
        self.span_loads = 0  # spans loaded (a standby promoted in place loads nothing)
        self.lost_dht = False
        self._lock = asyncio.Lock()

    def reached_at(self, reach: Reach) -> None:
        """Its records say so from the next announcement on."""
        self.reach = reach
        log.info("reached at", extra={"peer": self.peer_id, "maddrs": list(reach.maddrs)})

    @property
    def span(self) -> Span | None:
        return self._span

    @property
    def role(self) -> Role | None:
        return self._role

    # ---- spans ----------------------------------------------------------------------------------------------------
    async def _measure(self, backend: SpanRuntime | None, span: Span) -> None:
        """Per-block speeds: the configured number, or measured once on this device, in the runtime that serves, and
        cached."""
        throughput = self.cfg.compute.throughput
        if throughput is not None or backend is None:
            self.block_tps = self.block_sps = throughput or 0.0
            return
        key = self._cache_key(span)
        forward, inference = await asyncio.to_thread(cached_throughput, backend, self.cfg.cache_dir, key)
        self.block_tps, self.block_sps = forward * len(span), inference * len(span)

    def _cache_key(self, span: Span) -> str:
        c = self.cfg.compute
        return f"{self.model.fingerprint}-{span.start}-{span.end}-{c.device}-{c.threads}-{c.runtime}".replace(":", "_")

    async def hold(self, span: Span, role: Role) -> None:
        """Serve (or keep warm as a standby) ``span``. Make-before-break: a new span is loaded and announced before
        the old one is dropped; a standby promoted to the span it preloaded starts serving at once."""
        async with self._lock:
            fields = {"peer": self.peer_id, "span": str(span)}
            old = self._span
            if span != old:
                log.info("loading blocks as %s", role.value, extra=fields)
                backend, learner = await self.stage.load(span)
                self.span_loads += 1
                await self._measure(backend, span)
                self.engine.loaded.set(backend, learner)
                self._span = span
            elif role != self._role:
                log.info("%s -> %s", self._role.value if self._role else "none", role.value, extra=fields)
            self._role = role
            self.state = PeerState.ONLINE if role == Role.SERVE else PeerState.STANDBY
            self.engine.loaded.serving = role == Role.SERVE
            await self.publish()
            if old is not None and old != span:
                await self._retract(old, span)

    async def probe_speed(self) -> None:
        """Before the broker places it: measure one block (unless told its speed) so the broker can place it."""
        given = self.cfg.compute.throughput is not None
        await self._measure(None if given else await asyncio.to_thread(self.stage.probe), Span(0, 1))

    async def _retract(self, old: Span, new: Span) -> None:
        """Mark blocks of the old span that the new one lacks as left, so routes stop using them here."""
        gone = [b for b in old if b not in new]
        if gone:
            record = self._server_record(Span(gone[0], gone[-1] + 1), PeerState.LEAVING)
            await asyncio.to_thread(self.store.announce, record, dht_time() + self.cfg.timing.record_ttl)

    # ---- announcing -----------------------------------------------------------------------------------------------
    def _server_record(self, span: Span, state: PeerState) -> ServerRecord:
        per_block, per_block_steps = max(self.block_tps, 1e-9), max(self.block_sps, 1e-9)
        backend = self.engine.loaded.runtime  # None only before the first load, when no record is announced
        return ServerRecord(
            peer_id=self.peer_id,
            maddrs=self.reach.maddrs,
            state=state,
            start=span.start,
            end=span.end,
            model_id=self.model.name,
            num_blocks=self.model.num_blocks,
            fingerprint=self.model.fingerprint,
            revision=self.model.revision,
            dtype=self.model.dtype_name,
            quantization=self.model.quantization,
            device=self.hardware.device_name,
            device_memory=self.hardware.device_memory,
            forward_tps=per_block / len(span),
            inference_sps=per_block_steps / len(span),
            cache_tokens_free=self.sessions.tokens(self.sessions.budget.available, span),
            cache_tokens_total=self.sessions.tokens(self.sessions.budget.total, span),
            open_sessions=len(self.sessions.open),
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            requests_served=sum(self.engine.metrics.served.values()),
            direct_address=self.reach.direct_address,
            # the runtime serving the span and what it can do: routes that need a capability skip peers without it
            runtime=backend.name if backend is not None else "torch",
            capabilities=backend.capabilities if backend is not None else ALL_CAPABILITIES,
            network_mbps=self.network_mbps if self.network_mbps and self.network_mbps > 0 else None,
            reached=self.reach.reached,
            relays_for_others=self.cfg.network.relay,
            punch_via=self.reach.punch_via,
        )

    async def publish(self, state: PeerState | None = None) -> None:
        if state is not None:
            self.state = state
        now = dht_time()
        expiration = now + self.cfg.timing.record_ttl
        heartbeat = PeerRecord(
            peer_id=self.peer_id,
            state=self.state,
            start=self._span.start if self._span else None,
            end=self._span.end if self._span else None,
            pinned=self.cfg.placement.blocks is not None,
            block_throughput=self.block_tps,
            memory=self.max_blocks * self.model.block_bytes,
            block_bytes=self.model.block_bytes,
            max_blocks=self.max_blocks,
            updated_at=now,
            broker_capable=self.cfg.placement.broker,
            network_mbps=self.network_mbps,
            token_bytes=self.model.token_bytes,
        )
        await asyncio.to_thread(self.store.heartbeat, self.model.name, heartbeat, expiration)
        if self._span is not None:
            await asyncio.to_thread(self.store.announce, self._server_record(self._span, self.state), expiration)

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Refresh this peer's records; a peer that cannot reach its DHT (the DHT process died, or the machinery
        under it) is invisible to the swarm, so after a few failed rounds it leaves rather than lingers."""
        failures = 0
        while True:
            await asyncio.sleep(self.cfg.timing.announce_period)
            try:
                await self.publish()
                failures = 0
            except Exception:
                failures += 1
                log.exception("announce failed (%d in a row)", failures, extra={"peer": self.peer_id})
            if failures >= self.cfg.announce_failures or not self.store.alive():
                log.error("cannot reach the DHT any more; leaving", extra={"peer": self.peer_id})
                self.lost_dht = True
                stop.set()
                return

    def info(self) -> InfoReply:
        return InfoReply(
            peer_id=self.peer_id,
            start=self._span.start if self._span else None,
            end=self._span.end if self._span else None,
            role=self._role.value if self._role else None,
            model_id=self.model.name,
            fingerprint=self.model.fingerprint,
            stats=dict(self.engine.metrics.served) | {"prefix_reused": self.engine.metrics.prefix_reused},
            open_sessions=len(self.sessions.open),
            cache_tokens_free=self.sessions.tokens(self.sessions.budget.available, self._span),
            kept_activations=len(self.passes.kept),
            adapter_clients=len(self.engine.adapters.cache),
            adapter_bytes=self.engine.adapters.cache.nbytes,
            span_loads=self.span_loads,
            active=self.engine.metrics.active,
        )

    def snapshot(self, traffic: Mapping[str, int]) -> PeerSnapshot:
        """This peer's state now, for metrics (``traffic``: the bytes of its own calls as a client)."""
        budget, metrics, adapters = self.sessions.budget, self.engine.metrics, self.engine.adapters.cache
        stats, learner = metrics.served, self.engine.loaded.learner
        return PeerSnapshot(
            peer_id=self.peer_id,
            model=self.model.name,
            span=self._span,
            role=self._role.value if self._role else "",
            state=self.state.value,
            cache_bytes_total=budget.total,
            cache_bytes_used=budget.used,
            cache_tokens_free=self.sessions.tokens(budget.available, self._span),
            open_sessions=len(self.sessions.open),
            active_requests=metrics.active,
            kept_activations=len(self.passes.kept),
            adapter_clients=len(adapters),
            adapter_bytes=adapters.nbytes,
            adapter_uploads=stats.get("adapter_uploads", 0),
            not_kept=stats.get("not_kept", 0),
            sessions_opened=stats.get("sessions", 0),
            span_loads=self.span_loads,
            client_sent_bytes=traffic.get("sent_bytes", 0),
            client_received_bytes=traffic.get("received_bytes", 0),
            relay_slots=self.relay_stats.reservations if self.relay_stats else 0,
            relay_circuits=self.relay_stats.circuits_total if self.relay_stats else 0,
            relay_bytes=self.relay_stats.bytes_relayed if self.relay_stats else 0,
            punched=self.reach.punched(),
            punched_out=sum(n for key, n in traffic.items() if key.startswith("punched:")),
            averaging_bytes=learner.averaging_bytes if learner is not None else 0,
            rounds_undone=learner.rounds_undone if learner is not None else 0,
            replica_heals=learner.replica_heals if learner is not None else 0,
            prefix_bytes=budget.spare.nbytes if budget.spare is not None else 0,
        )
