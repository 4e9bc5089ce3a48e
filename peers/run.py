"""Runs one volunteer peer, in phases that each return what the next one needs: ``join`` (its DHT, measured
reachability: ``peers.joining``), ``build`` (its own calls, the engine room, session table and pass service, the stage
attached), the ``Peer`` built whole from them, ``start_roles`` (the RPC servicer on libp2p and the direct data plane,
relay slots and hole punching: where others reach it), ``start_work`` (its span, heartbeat, follower, broker
candidate and the stage's own work), its metrics and the dashboard the entry point hands in; and ``leave``. What a
phase starts is closed by the exit stack it is handed, in reverse, however the peer ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from hivemind.p2p import P2P

from peers.broker.loop import run_broker
from peers.broker.planner import Policy, Role
from peers.config import PeerConfig
from peers.follower import run_follower
from peers.hardware import probe_hardware, trim_freed_memory, usable_memory
from peers.joining import (
    Joined,
    admit_of,
    announced_maddrs,
    direct_address,
    directory_of,
    estimate_link,
    join,
    punching,
)
from peers.judge import BrokerJudge
from peers.node import Peer, Reach, Serving
from peers.observe import Dashboard, Observers, start_metrics
from peers.reach import reachable
from peers.relay_admission import Admission
from peers.relay_service import RelayService, RelayStats
from peers.relay_slots import RelaySlots
from peers.rpc.assembly import assemble
from peers.rpc.direct_server import DirectLimits, DirectServer
from peers.rpc.edge import Edge
from peers.rpc.framing import StreamLimits
from peers.rpc.p2p_server import P2PStreams
from peers.rpc.servicer import Servicer
from peers.serving.checks import Limits
from peers.serving.config import within_memory
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget, KvCost
from peers.serving.limits import Quota
from peers.serving.pass_service import PassService
from peers.serving.prefixes import PrefixStore
from peers.serving.sessions import SessionTable
from peers.serving.stage_port import ModelInfo, Stage, StageEnv
from swarm import wire
from swarm.circuit import take_hop
from swarm.dht import RecordStore, dht_time
from swarm.errors import BadInputError, DhtLostError
from swarm.records import PeerState
from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)
Tasks = list[asyncio.Task[None]]


@dataclass(frozen=True)
class Built:
    """What serves on a peer, and its own calls: ``build``'s result."""

    serving: Serving
    p2p: P2P
    remote: Remote
    relay_stats: RelayStats | None  # --relay: what it relays for others (``peers.relay_service``)
    network_mbps: float | None  # declared, or estimated once at start


async def run_peer(
    cfg: PeerConfig,
    stage: Stage,
    stop: asyncio.Event,
    on_ready: Callable[[list[str]], None] | None = None,
    dashboard: Dashboard | None = None,
) -> None:
    """Run one peer until ``stop`` is set. ``dashboard`` serves ``--dashboard-port`` (the entry point hands in
    ``swarm.dashboard.peer.serve_peer_dashboard``: the node imports no web app)."""
    cfg = _prepared(cfg, stage)
    limit = max_blocks(cfg, stage.model)
    joined = await join(cfg, stage.model)
    peer: Peer | None = None
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(joined.store.shutdown)
        built = await build(cfg, stage, joined, limit, stack)
        hardware = probe_hardware(cfg.compute.device)
        reach = Reach(joined.relay.reached, announced_maddrs(joined))
        peer = Peer(
            cfg, stage, joined.store, hardware, limit, built.serving, reach, built.relay_stats, built.network_mbps
        )
        tasks: Tasks = []
        observers = Observers()
        stack.push_async_callback(_stop, tasks, observers)
        await start_roles(cfg, joined, built, peer, stop, stack, tasks)
        await start_work(cfg, stage, built, peer, stop, tasks)
        await _observe(cfg, peer, built.remote, observers, dashboard)
        log.info("ready", extra={"peer": peer.peer_id, "span": str(peer.span)})
        if on_ready is not None:
            on_ready(list(peer.reach.maddrs))
        await stop.wait()
        await leave(peer, tasks)
    if peer is not None and peer.lost_dht:
        raise DhtLostError("this peer lost its DHT (its DHT process died) and left the swarm")


def _prepared(cfg: PeerConfig, stage: Stage) -> PeerConfig:
    """The configuration checked, its compute caps within this machine's memory; torch's threads set."""
    cfg.check()
    cfg = replace(cfg, compute=within_memory(cfg.compute))
    torch.set_num_threads(cfg.compute.threads)
    if cfg.placement.blocks is not None:
        stage.check_pinned(cfg.placement.blocks)
    return cfg


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


async def build(cfg: PeerConfig, stage: Stage, joined: Joined, limit: int, stack: contextlib.AsyncExitStack) -> Built:
    """This peer's own calls (and relaying for others, with ``--relay``), its engine room with the session table and
    the pass service on it, and its stage attached to them."""
    store, model = joined.store, stage.model
    p2p = await store.replicate_p2p()
    relay_service = RelayService(p2p, joined.relay, relay_admission(cfg, store, model)) if joined.relay.offer else None
    if relay_service is not None:
        await take_hop(p2p, relay_service.handle)
    remote = Remote(p2p, store.credentials(), max_reply_bytes=cfg.compute.max_message_bytes)
    stack.callback(remote.close)
    engine = Engine(_limits(cfg, model), cfg.compute, cfg.timing)
    stack.callback(engine.close)
    stack.callback(stage.close)
    sessions = _session_table(cfg, model, engine, limit)
    serving = Serving(engine, sessions, PassService(engine, cfg.compute, cfg.timing))
    stage.attach(StageEnv(store, remote, store.peer_id, engine, cfg.timing))
    mbps = await estimate_link(cfg, store, model, remote)
    return Built(serving, p2p, remote, relay_service.stats if relay_service is not None else None, mbps)


def relay_admission(cfg: PeerConfig, store: RecordStore, model: ModelInfo) -> Admission:
    """Slots for peers whose own heartbeat is in this model's swarm (``peers.relay_admission``), written within a
    record's life: a peer behind NAT writes one before it reserves, and refreshes it only once it holds its slots."""
    timing = cfg.timing

    async def member(peer_id: str) -> bool:
        record = await asyncio.to_thread(store.heartbeat_of, model.name, peer_id)
        if record is None or record.state == PeerState.LEAVING:
            return False
        return -timing.clock_skew <= dht_time() - record.updated_at <= timing.record_ttl

    return Admission(member)


def _limits(cfg: PeerConfig, model: ModelInfo) -> Limits:
    positions = getattr(model.config, "max_position_embeddings", None)
    return Limits(
        int(model.config.hidden_size),
        model.dtype,
        model.num_blocks,
        cfg.compute.max_batch_tokens,
        int(positions) if isinstance(positions, int) else None,
    )


def _session_table(cfg: PeerConfig, model: ModelInfo, engine: Engine, limit: int) -> SessionTable:
    """Sessions under the KV-cache budget: ``--cache-bytes``, or ``--cache-tokens`` through ``limit`` blocks."""
    c = cfg.compute
    cost = KvCost(model.family, model.dtype.itemsize)
    total = c.cache_bytes if c.cache_bytes is not None else cost.budget_for(c.cache_tokens, limit)
    budget = CacheBudget(total, per_caller=int(total * c.caller_cache_share))
    quota = Quota("open sessions", c.max_caller_sessions, c.max_sessions, ("--max-caller-sessions", "--max-sessions"))
    table = SessionTable(engine, budget, cfg.timing.cache_wait, quota, cost, c.prefill_chunk)
    if c.prefix_cache:
        table.prefixes = PrefixStore(budget, table.prefix_cost, share=c.share_prefixes)
    return table


async def start_roles(
    cfg: PeerConfig,
    joined: Joined,
    built: Built,
    peer: Peer,
    stop: asyncio.Event,
    stack: contextlib.AsyncExitStack,
    tasks: Tasks,
) -> Servicer:
    """The RPC servicer on libp2p and, with ``--direct-port``, on the direct data plane; a private peer's relay slots
    and hole punching. Where others reach the peer goes into its records (``Peer.reached_at``)."""
    net, timing, c = joined.net, cfg.timing, cfg.compute
    budget = wire.ByteBudget(c.max_held_bytes, c.max_caller_held_bytes)
    edge = Edge(
        peer.engine.metrics, timing, c.max_message_bytes, budget, admit_of(joined.store), net.added_latency_ms / 1000
    )
    directory = directory_of(joined.store, peer.model, timing.record_ttl)
    serving = built.serving
    servicer = assemble(
        edge,
        serving.engine.limits,
        serving.passes,
        serving.sessions,
        peer.info,
        peer.stage.training,
        built.remote,
        directory,
    )
    if servicer.pusher is not None:
        stack.callback(servicer.pusher.close)
    streams = StreamLimits(read_timeout=timing.message_timeout, write_timeout=timing.write_timeout)
    quota = Quota(
        "open streams",
        net.max_caller_connections,
        net.max_connections,
        ("--max-caller-connections", "--max-connections"),
    )
    await servicer.register(built.p2p, P2PStreams(budget, streams, quota))
    if joined.relay.reached == "relayed" and not net.announce_maddrs:  # announce only relayed addresses that work
        await peer.publish(PeerState.JOINING)  # relays grant slots only to peers whose heartbeat they find
        slots = RelaySlots(built.p2p, joined.relay.relays)
        await slots.first(timing.dht_start_timeout)
        maddrs = await reachable(peer.peer_id, tuple(slots.maddrs(peer.peer_id)), timing.dht_start_timeout)
        log.info("reachable through relays", extra={"peer": peer.peer_id, "maddrs": maddrs})
        peer.reached_at(replace(peer.reach, maddrs=tuple(maddrs)))
        relayed = lambda maddrs: peer.reached_at(replace(peer.reach, maddrs=tuple(maddrs)))  # noqa: E731
        tasks.append(asyncio.create_task(slots.run(stop, relayed, peer.peer_id)))
    if net.direct_port is not None:
        await _direct_plane(cfg, joined, built, peer, servicer, streams, stop, stack, tasks)
    return servicer


async def _direct_plane(
    cfg: PeerConfig,
    joined: Joined,
    built: Built,
    peer: Peer,
    servicer: Servicer,
    streams: StreamLimits,
    stop: asyncio.Event,
    stack: contextlib.AsyncExitStack,
    tasks: Tasks,
) -> None:
    """The direct data plane: dialled at its address, or, behind a NAT, punched through to where its NAT allows."""
    net, store = joined.net, joined.store
    limits = DirectLimits(
        net.max_connections, net.max_caller_connections, net.handshake_timeout or cfg.timing.handshake_timeout
    )
    direct = DirectServer(servicer, store.credentials(), limits, admit_of(store), streams)
    stack.push_async_callback(direct.close)
    port = await direct.start(net.host, net.direct_port or 0)
    if joined.relay.reached != "relayed":
        peer.reached_at(replace(peer.reach, direct_address=direct_address(net, port)))
        return
    puncher = await punching(joined, built.p2p, direct, peer.model, cfg.timing.handshake_timeout)
    if puncher is not None:
        stack.callback(puncher.close)
        peer.reached_at(replace(peer.reach, punch_via=puncher.observers(), punched=puncher.count))
        tasks.append(asyncio.create_task(puncher.run(stop)))


async def start_work(
    cfg: PeerConfig, stage: Stage, built: Built, peer: Peer, stop: asyncio.Event, tasks: Tasks
) -> None:
    """The peer's span (pinned: served at once; else announced as joining, for the broker to place), and the work
    that runs as long as it does: heartbeat, kept activations' expiry, follower, broker candidate, the stage's own."""
    store, model, timing, placement = peer.store, peer.model, cfg.timing, cfg.placement
    if placement.blocks is not None:
        await peer.hold(placement.blocks, Role.SERVE)
    else:
        await peer.probe_speed()
        await peer.publish(PeerState.JOINING)
    tasks.append(asyncio.create_task(peer.heartbeat(stop)))
    tasks.append(asyncio.create_task(_expire_kept(peer.passes, timing.activation_ttl / 4)))
    if placement.blocks is None:
        tasks.append(asyncio.create_task(run_follower(store, model.name, model.num_blocks, peer, timing)))
    if placement.broker:
        policy = Policy(replication=placement.replication, standby_fraction=placement.standby_fraction)
        planner = lambda peers: stage.plan(peers, policy)  # noqa: E731
        judge = BrokerJudge(
            store,
            built.remote,
            model.name,
            model.num_blocks,
            timing,
            stage.local_judge(),
            peer.engine.metrics.accusations,
        )
        broker = run_broker(store, model.name, planner, timing, judge.convicted)
        tasks += [asyncio.create_task(broker), asyncio.create_task(judge.run())]
    tasks += [asyncio.create_task(work) for work in stage.background()]


async def _stop(tasks: Tasks, observers: Observers) -> None:
    for task in tasks:
        task.cancel()
    with contextlib.suppress(Exception):
        await asyncio.gather(*tasks, return_exceptions=True)
    observers.close()


async def _expire_kept(passes: PassService, period: float) -> None:
    """Kept forwards whose backward never came are dropped at their ttl even when no request comes to do it, and
    what the allocator holds free goes back to the system (``trim_freed_memory``)."""
    while True:
        await asyncio.sleep(period)
        passes.kept.expire()
        trim_freed_memory()


async def _observe(
    cfg: PeerConfig, peer: Peer, remote: Remote, observers: Observers, dashboard: Dashboard | None
) -> None:
    obs = cfg.observe
    if obs.metrics_port is not None:
        start_metrics(observers, obs, peer.engine.metrics, lambda: peer.snapshot(remote.traffic))
    if obs.dashboard_port is not None:
        if dashboard is None:
            raise BadInputError("--dashboard-port: this launcher of the peer serves no dashboard")
        model = peer.model
        url, close = await dashboard(
            peer.store, remote, model.name, model.num_blocks, cfg.timing, peer.info, obs.http_host, obs.dashboard_port
        )
        observers.add("dashboard", url, close)


async def leave(peer: Peer, tasks: Tasks) -> None:
    """Quit politely: refuse new sessions and say so in every reply to the open ones (their clients ready the span
    elsewhere and move at a step boundary: ``swarm.client.session.handover``), announce leaving so the broker moves
    the span and new sessions go elsewhere, and serve the open sessions until they have moved or finished, for
    ``Timing.leave_grace`` at most (a session still open then fails over with a replay)."""
    log.info("leaving", extra={"peer": peer.peer_id, "span": str(peer.span)})
    sessions = peer.sessions
    sessions.leaving = True  # first: the very next reply tells its client
    for task in tasks:
        task.cancel()
    if not peer.lost_dht:
        try:
            await asyncio.wait_for(peer.publish(PeerState.LEAVING), peer.cfg.timing.open_timeout)
        except Exception:
            log.warning("could not announce leaving", extra={"peer": peer.peer_id})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + peer.cfg.timing.leave_grace
    while sessions.open and loop.time() < deadline:
        await asyncio.sleep(0.1)
    log.info("left with %d sessions still open", len(sessions.open), extra={"peer": peer.peer_id})
