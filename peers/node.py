"""Wires one volunteer peer together: DHT, the stage it serves (whose span can change), compute, RPC servicer,
announcer, follower and broker candidate. The node never asks what kind of stage it runs (``peers.serving.stage``),
and serves no web app of its own: metrics read its frozen snapshots, and the dashboard is handed in."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

import torch

from peers.broker.loop import run_broker
from peers.broker.planner import Policy, Role
from peers.config import PeerConfig
from peers.follower import run_follower
from peers.hardware import Hardware, cached_throughput, estimate_link_mbps, probe_hardware, usable_memory
from peers.metrics import PeerSnapshot
from peers.observe import Dashboard, Observers, start_metrics
from peers.rpc.direct_server import DirectLimits, DirectServer
from peers.rpc.servicer import Admit, Servicer
from peers.serving.checks import Limits
from peers.serving.compute import ComputeService
from peers.serving.kv_cache import CacheBudget, KvCost
from peers.serving.limits import Quota
from peers.serving.runtime import SpanRuntime
from peers.serving.sessions import Sessions
from peers.serving.stage import ModelInfo, Stage, StageEnv
from swarm import wire
from swarm.dht import RecordStore, dht_time, start_dht
from swarm.errors import BadInputError, DhtLostError
from swarm.ids import Span, peers_key
from swarm.membership import swarm_key_for
from swarm.protocol import PROTOCOL_VERSION, InfoReply
from swarm.records import ALL_CAPABILITIES, PeerRecord, PeerState, ServerRecord, servers
from swarm.rpc.remote import Remote
from swarm.version import __version__

log = logging.getLogger(__name__)


def _direct_address(cfg: PeerConfig, port: int) -> str | None:
    """Where others should dial the TCP data plane: the listen host, or the announced IP behind a wildcard."""
    host = cfg.network.host
    if host in ("0.0.0.0", "::"):
        announced = [m.split("/")[2] for m in cfg.network.announce_maddrs if m.startswith(("/ip4/", "/ip6/"))]
        if not announced:
            return None  # nobody could dial a wildcard address; libp2p only
        host = announced[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _admit(store: RecordStore) -> Admit | None:
    """Who may call this peer's RPCs: anyone in an open swarm (None), holders of its key in a private one."""
    key = store.swarm_key
    return key.admits if key is not None else None


class Peer:
    """One peer's changing state: the span it holds, what it does with it, and how it tells the swarm."""

    def __init__(
        self,
        cfg: PeerConfig,
        stage: Stage,
        store: RecordStore,
        hardware: Hardware,
        max_blocks: int,
        compute: ComputeService,
        sessions: Sessions,
    ) -> None:
        self.cfg, self.stage, self.model, self.store = cfg, stage, stage.model, store
        self.hardware, self.max_blocks, self.compute, self.sessions = hardware, max_blocks, compute, sessions
        self.peer_id = store.peer_id
        self._span: Span | None = None
        self._role: Role | None = None
        self.state = PeerState.JOINING
        self.block_tps = 0.0  # forward tokens/s of one block
        self.block_sps = 0.0  # single-token inference steps/s of one block
        self.span_loads = 0  # spans loaded (a standby promoted in place loads nothing)
        self.maddrs: list[str] = []
        self.direct_address: str | None = None
        self.network_mbps = cfg.network.network_mbps  # declared, or estimated once at start
        self.lost_dht = False
        self._lock = asyncio.Lock()

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
                self.compute.set_backend(backend, learner)
                self._span = span
            elif role != self._role:
                log.info("%s -> %s", self._role.value if self._role else "none", role.value, extra=fields)
            self._role = role
            self.state = PeerState.ONLINE if role == Role.SERVE else PeerState.STANDBY
            self.compute.serving = role == Role.SERVE
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
        backend = self.compute.backend  # None only before the first load, when no record is announced
        return ServerRecord(
            peer_id=self.peer_id,
            maddrs=tuple(self.maddrs),
            state=state,
            start=span.start,
            end=span.end,
            model_id=self.model.name,
            num_blocks=self.model.num_blocks,
            fingerprint=self.model.fingerprint,
            dtype=self.model.dtype_name,
            device=self.hardware.device_name,
            device_memory=self.hardware.device_memory,
            forward_tps=per_block / len(span),
            inference_sps=per_block_steps / len(span),
            cache_tokens_free=self.sessions.tokens(self.sessions.budget.free, span),
            cache_tokens_total=self.sessions.tokens(self.sessions.budget.total, span),
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            requests_served=sum(self.compute.stats.values()),
            direct_address=self.direct_address,
            # the runtime serving the span and what it can do: routes that need a capability skip peers without it
            runtime=backend.name if backend is not None else "torch",
            capabilities=backend.capabilities if backend is not None else ALL_CAPABILITIES,
            network_mbps=self.network_mbps if self.network_mbps and self.network_mbps > 0 else None,
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
            max_blocks=self.max_blocks,
            updated_at=now,
            broker_capable=self.cfg.placement.broker,
            network_mbps=self.network_mbps,
            token_bytes=self.model.token_bytes,
        )
        await asyncio.to_thread(self.store.publish, peers_key(self.model.name), heartbeat, expiration)
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
            stats=dict(self.compute.stats),
            open_sessions=len(self.sessions.open),
            cache_tokens_free=self.sessions.tokens(self.sessions.budget.free, self._span),
            kept_activations=len(self.compute.kept),
            adapter_clients=len(self.compute.adapters),
            adapter_bytes=self.compute.adapters.nbytes,
            span_loads=self.span_loads,
            active=self.compute.active,
        )

    def snapshot(self, traffic: Mapping[str, int]) -> PeerSnapshot:
        """This peer's state now, for metrics (``traffic``: the bytes of its own calls as a client)."""
        budget, compute, stats = self.sessions.budget, self.compute, self.compute.stats
        return PeerSnapshot(
            peer_id=self.peer_id,
            model=self.model.name,
            span=self._span,
            role=self._role.value if self._role else "",
            state=self.state.value,
            cache_bytes_total=budget.total,
            cache_bytes_used=budget.used,
            cache_tokens_free=self.sessions.tokens(budget.free, self._span),
            open_sessions=len(self.sessions.open),
            active_requests=compute.active,
            kept_activations=len(compute.kept),
            adapter_clients=len(compute.adapters),
            adapter_bytes=compute.adapters.nbytes,
            adapter_uploads=stats.get("adapter_uploads", 0),
            not_kept=stats.get("not_kept", 0),
            sessions_opened=stats.get("sessions", 0),
            span_loads=self.span_loads,
            client_sent_bytes=traffic.get("sent_bytes", 0),
            client_received_bytes=traffic.get("received_bytes", 0),
        )


def max_blocks(cfg: PeerConfig, model: ModelInfo) -> int:
    """How many blocks this peer offers: its pinned span, else what its memory holds (up to --max-blocks)."""
    if cfg.placement.blocks is not None:
        return len(cfg.placement.blocks)
    fits = usable_memory(cfg.compute.device) // max(model.block_bytes, 1)
    cap = cfg.placement.max_blocks
    limit = min(fits, model.num_blocks, model.num_blocks if cap is None else cap)
    if limit < 1:
        raise BadInputError(
            f"too little memory for even one block of {model.name} ({model.block_bytes / 2**20:.0f} MiB in "
            f"{model.dtype_name}): this peer cannot serve it"
        )
    return limit


async def _estimate_link(peer: Peer, remote: Remote) -> None:
    try:
        view = await asyncio.to_thread(peer.store.view, peer.model.name, peer.model.num_blocks)
        net, timing = peer.cfg.network, peer.cfg.timing
        records = list(servers(view).values())
        peer.network_mbps = await estimate_link_mbps(
            remote, records, peer.peer_id, net.probe_bytes, timing.probe_timeout
        )
        shown = f"{peer.network_mbps:.0f}" if peer.network_mbps else "unknown"
        log.info("link estimate %s Mbit/s", shown, extra={"peer": peer.peer_id})
    except Exception:
        log.warning("could not estimate the link", extra={"peer": peer.peer_id})


async def run_peer(
    cfg: PeerConfig,
    stage: Stage,
    stop: asyncio.Event,
    on_ready: Callable[[list[str]], None] | None = None,
    dashboard: Dashboard | None = None,
) -> None:
    """Run one peer until ``stop`` is set. ``dashboard`` serves ``--dashboard-port`` (the entry point hands in
    ``swarm.dashboard.peer.serve_peer_dashboard``: the node imports no web app)."""
    cfg.check()
    torch.set_num_threads(cfg.compute.threads)
    model = stage.model
    if cfg.placement.blocks is not None:
        stage.check_pinned(cfg.placement.blocks)
    limit = max_blocks(cfg, model)
    net = cfg.network
    swarm_key = swarm_key_for(net.swarm_key, new_swarm=net.new_swarm)
    # The DHT forks a child: do it before torch starts its thread pools and before the weights fill memory.
    store = start_dht(
        initial_peers=net.initial_peers,
        host=net.host,
        port=net.port,
        announce_maddrs=net.announce_maddrs,
        identity=net.identity,
        timeout=cfg.timing.dht_start_timeout,
        call_timeout=cfg.timing.dht_timeout,
        swarm_key=swarm_key,
    )
    positions = getattr(model.config, "max_position_embeddings", None)
    limits = Limits(
        int(model.config.hidden_size),
        model.dtype,
        model.num_blocks,
        cfg.compute.max_batch_tokens,
        int(positions) if isinstance(positions, int) else None,
    )
    compute = ComputeService(limits, cfg.compute, cfg.timing)
    c = cfg.compute
    cost = KvCost(model.family, model.dtype.itemsize)
    total = c.cache_bytes if c.cache_bytes is not None else cost.budget_for(c.cache_tokens, limit)
    budget = CacheBudget(total, per_caller=int(total * c.caller_cache_share))
    quota = Quota("open sessions", c.max_caller_sessions, c.max_sessions, ("--max-caller-sessions", "--max-sessions"))
    sessions = Sessions(compute, budget, cfg.timing.cache_wait, c.inline_tokens, quota, cost)
    tasks: list[asyncio.Task[None]] = []
    direct: DirectServer | None = None
    remote: Remote | None = None
    servicer: Servicer | None = None
    peer: Peer | None = None
    observers = Observers()
    try:
        p2p = await store.replicate_p2p()
        remote = Remote(p2p, store.credentials(), max_reply_bytes=cfg.compute.max_message_bytes)
        stage.attach(StageEnv(store, remote, store.peer_id, compute, cfg.timing))
        peer = Peer(cfg, stage, store, probe_hardware(cfg.compute.device), limit, compute, sessions)
        peer.maddrs = [
            m if "/p2p/" in m else f"{m}/p2p/{peer.peer_id}" for m in (net.announce_maddrs or store.visible_maddrs())
        ]
        servicer = Servicer(
            compute,
            sessions,
            peer.info,
            max_bytes=cfg.compute.max_message_bytes,
            timing=cfg.timing,
            added_latency_s=net.added_latency_ms / 1000,
            training=stage.training,
            admit=_admit(store),
            budget=wire.ByteBudget(cfg.compute.max_held_bytes),
            remote=remote,
        )
        await servicer.register(p2p)
        if net.direct_port is not None:
            limits_direct = DirectLimits(
                net.max_connections, net.max_caller_connections, net.handshake_timeout or cfg.timing.handshake_timeout
            )
            direct = DirectServer(servicer, store.credentials(), limits_direct, _admit(store))
            peer.direct_address = _direct_address(cfg, await direct.start(net.host, net.direct_port))
        if peer.network_mbps is None and net.initial_peers:
            await _estimate_link(peer, remote)
        if cfg.placement.blocks is not None:
            await peer.hold(cfg.placement.blocks, Role.SERVE)
        else:
            await peer.probe_speed()
            await peer.publish(PeerState.JOINING)
        tasks.append(asyncio.create_task(peer.heartbeat(stop)))
        if cfg.placement.blocks is None:
            tasks.append(asyncio.create_task(run_follower(store, model.name, model.num_blocks, peer, cfg.timing)))
        if cfg.placement.broker:
            policy = Policy(replication=cfg.placement.replication, standby_fraction=cfg.placement.standby_fraction)
            planner = lambda peers: stage.plan(peers, policy)  # noqa: E731
            tasks.append(asyncio.create_task(run_broker(store, model.name, planner, cfg.timing)))
        tasks += [asyncio.create_task(work) for work in stage.background()]
        await _observe(cfg, peer, remote, observers, dashboard)
        log.info("ready", extra={"peer": peer.peer_id, "span": str(peer.span)})
        if on_ready is not None:
            on_ready(peer.maddrs)
        await stop.wait()
        await _leave(peer, sessions, tasks)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        observers.close()
        if direct is not None:
            await direct.close()
        if servicer is not None and servicer.relay is not None:
            servicer.relay.close()
        stage.close()
        compute.close()
        if remote is not None:
            remote.close()
        store.shutdown()
    if peer is not None and peer.lost_dht:
        raise DhtLostError("this peer lost its DHT (its DHT process died) and left the swarm")


async def _observe(
    cfg: PeerConfig, peer: Peer, remote: Remote, observers: Observers, dashboard: Dashboard | None
) -> None:
    obs = cfg.observe
    if obs.metrics_port is not None:
        start_metrics(observers, obs, peer.compute.metrics, lambda: peer.snapshot(remote.traffic))
    if obs.dashboard_port is not None:
        if dashboard is None:
            raise BadInputError("--dashboard-port: this launcher of the peer serves no dashboard")
        model = peer.model
        url, close = await dashboard(
            peer.store, remote, model.name, model.num_blocks, cfg.timing, peer.info, obs.http_host, obs.dashboard_port
        )
        observers.add("dashboard", url, close)


async def _leave(peer: Peer, sessions: Sessions, tasks: list[asyncio.Task[None]]) -> None:
    log.info("leaving", extra={"peer": peer.peer_id, "span": str(peer.span)})
    for task in tasks:
        task.cancel()
    sessions.leaving = True
    if not peer.lost_dht:
        try:
            await asyncio.wait_for(peer.publish(PeerState.LEAVING), peer.cfg.timing.open_timeout)
        except Exception:
            log.warning("could not announce leaving", extra={"peer": peer.peer_id})
    # New sessions now avoid this peer; give the open ones a grace period to finish (or fail over).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + peer.cfg.timing.leave_grace
    while sessions.open and loop.time() < deadline:
        await asyncio.sleep(0.1)
