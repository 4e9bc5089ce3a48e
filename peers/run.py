"""Runs one volunteer peer: its DHT, the stage it serves, compute, the RPC servicer and the direct data plane, the
announcer, follower and broker candidate, its metrics and the dashboard the entry point hands in; and its leaving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from hivemind.p2p import P2P

from peers.broker.loop import run_broker
from peers.broker.planner import Policy, Role
from peers.config import NetworkConfig, PeerConfig
from peers.follower import run_follower
from peers.hardware import estimate_link_mbps, probe_hardware, trim_freed_memory, usable_memory
from peers.judge import BrokerJudge
from peers.node import Peer
from peers.observe import Dashboard, Observers, start_metrics
from peers.reach import measure, reachable
from peers.relay_service import RelayService
from peers.relay_slots import RelaySlots
from peers.rpc.direct_server import DirectLimits, DirectServer
from peers.rpc.directory import ServerDirectory
from peers.rpc.framing import StreamLimits
from peers.rpc.p2p_server import P2PStreams
from peers.rpc.punch_server import Puncher
from peers.rpc.servicer import Admit, Servicer
from peers.serving.checks import Limits
from peers.serving.compute import ComputeService
from peers.serving.config import within_memory
from peers.serving.kv_cache import CacheBudget, KvCost
from peers.serving.limits import Quota
from peers.serving.sessions import Sessions
from peers.serving.stage import ModelInfo, Stage, StageEnv
from swarm import wire
from swarm.circuit import take_hop
from swarm.dht import RecordStore, start_dht
from swarm.errors import BadInputError, DhtLostError
from swarm.ids import block_key
from swarm.membership import SwarmKey, swarm_key_for
from swarm.protocol import RPC_PUNCH
from swarm.records import OBSERVER, PeerState, ServerRecord, servers
from swarm.relay import RelayPolicy, relay_peer
from swarm.rpc.remote import Remote

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


def _relayed(peer: Peer, maddrs: list[str]) -> None:
    """The relays holding a slot changed: the next records say so."""
    peer.maddrs = maddrs
    log.info("relayed addresses", extra={"peer": peer.peer_id, "maddrs": maddrs})


def _join(net: NetworkConfig, relay: RelayPolicy, cfg: PeerConfig, swarm_key: SwarmKey | None) -> RecordStore:
    """This peer's DHT, joined as ``relay`` says (a private peer's in client mode)."""
    return start_dht(
        initial_peers=net.initial_peers,
        host=net.host,
        port=net.port,
        announce_maddrs=net.announce_maddrs,
        identity=net.identity,
        timeout=cfg.timing.dht_start_timeout,
        call_timeout=cfg.timing.dht_timeout,
        swarm_key=swarm_key,
        relay=relay,
        client_mode=relay.dht_client,
    )


async def _measured(
    net: NetworkConfig, store: RecordStore, model: ModelInfo, timeout: float
) -> tuple[NetworkConfig, RelayPolicy]:
    """``--reachability auto``, found out: public peers dial this one back at its libp2p port; behind a NAT it then
    serves as a private peer does (relay slots, relayed addresses, punching). Unknown (nobody answered): as it
    was."""
    ports = [int(m.split("/tcp/")[1].split("/")[0]) for m in store.visible_maddrs() if "/tcp/" in m]
    measured = await measure(store, model.name, model.num_blocks, ports[0], timeout) if ports else None
    log.info("reachability measured: %s", measured or "unknown", extra={"peer": store.peer_id})
    if measured is not None:
        net = replace(net, reachability=measured)
    return net, net.relay_policy()


def _maddrs(net: NetworkConfig, relay: RelayPolicy, store: RecordStore) -> list[str]:
    """The addresses this peer's records announce: those given, its relayed ones when private (what p2pd listens
    on is unreachable then), else what p2pd reports."""
    if relay.reached == "relayed" and not net.announce_maddrs:
        return list(relay.relayed_maddrs(store.peer_id))
    return [m if "/p2p/" in m else f"{m}/p2p/{store.peer_id}" for m in (net.announce_maddrs or store.visible_maddrs())]


def _admit(store: RecordStore) -> Admit | None:
    """Who may call this peer's RPCs: anyone in an open swarm (None), holders of its key in a private one."""
    key = store.swarm_key
    return key.admits if key is not None else None


def _directory(store: RecordStore, model: ModelInfo, ttl: float) -> ServerDirectory:
    """The servers of this model with our weights, from their signed records: whom chaining trusts."""
    return ServerDirectory(
        lambda block: store.read(block_key(model.name, block), ServerRecord),
        model.chain_fingerprints,
        model.num_blocks,
        ttl,
    )


async def _punching(
    store: RecordStore, p2p: P2P, direct: DirectServer, model: ModelInfo, relay: RelayPolicy, timeout: float
) -> Puncher | None:
    """Hole punching for a peer behind NAT, observed through its relays' direct planes (their records say where),
    or None where none answers (callers then stay on the relayed path)."""
    relays = {relay_peer(r) for r in relay.relays}
    records = servers(await asyncio.to_thread(store.view, model.name, model.num_blocks)).values()
    observers = tuple(
        f"{r.peer_id}@{r.direct_address}"
        for r in records
        if r.peer_id in relays and r.direct_address and re.match(OBSERVER, f"{r.peer_id}@{r.direct_address}")
    )[:4]
    puncher = Puncher(direct, store.credentials(), lambda: observers, _admit(store), timeout)
    if not observers or not await puncher.refresh():
        log.warning("no hole punching: no relay's direct plane told this peer its address")
        return None
    await p2p.add_protobuf_handler(RPC_PUNCH, puncher.rpc_punch, wire.Frame)
    return puncher


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
    cfg = replace(cfg, compute=within_memory(cfg.compute))
    torch.set_num_threads(cfg.compute.threads)
    model = stage.model
    if cfg.placement.blocks is not None:
        stage.check_pinned(cfg.placement.blocks)
    limit = max_blocks(cfg, model)
    net = cfg.network
    swarm_key = swarm_key_for(net.swarm_key, new_swarm=net.new_swarm)
    # The DHT forks a child: do it before torch starts its thread pools and before the weights fill memory.
    relay = net.relay_policy()
    store = _join(net, relay, cfg, swarm_key)
    if net.reachability == "auto" and net.initial_peers and not net.announce_maddrs:
        try:
            net, relay = await _measured(net, store, model, cfg.timing.handshake_timeout)
        except BaseException:
            store.shutdown()
            raise
        if relay.reached == "relayed":  # behind a NAT: joined again as a private peer (its DHT in client mode)
            store.shutdown()
            store = _join(net, relay, cfg, swarm_key)
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
    sessions = Sessions(compute, budget, cfg.timing.cache_wait, quota, cost, c.prefill_chunk)
    tasks: list[asyncio.Task[None]] = []
    direct: DirectServer | None = None
    puncher: Puncher | None = None
    remote: Remote | None = None
    servicer: Servicer | None = None
    peer: Peer | None = None
    observers = Observers()
    try:
        p2p = await store.replicate_p2p()
        relay_service = RelayService(p2p, relay) if relay.offer else None
        if relay_service is not None:
            await take_hop(p2p, relay_service.handle)
        remote = Remote(p2p, store.credentials(), max_reply_bytes=cfg.compute.max_message_bytes)
        stage.attach(StageEnv(store, remote, store.peer_id, compute, cfg.timing))
        peer = Peer(cfg, stage, store, probe_hardware(cfg.compute.device), limit, compute, sessions)
        peer.relay_stats = relay_service.stats if relay_service is not None else None
        peer.maddrs = _maddrs(net, relay, store)
        peer.reached = relay.reached
        servicer = Servicer(
            compute,
            sessions,
            peer.info,
            max_bytes=cfg.compute.max_message_bytes,
            timing=cfg.timing,
            added_latency_s=net.added_latency_ms / 1000,
            training=stage.training,
            admit=_admit(store),
            budget=wire.ByteBudget(c.max_held_bytes, c.max_caller_held_bytes),
            remote=remote,
            directory=_directory(store, model, cfg.timing.record_ttl),
        )
        streams = StreamLimits(read_timeout=cfg.timing.message_timeout, write_timeout=cfg.timing.write_timeout)
        flags = ("--max-caller-connections", "--max-connections")
        quota = Quota("open streams", net.max_caller_connections, net.max_connections, flags)
        await servicer.register(p2p, P2PStreams(servicer.budget, streams, quota))
        if relay.reached == "relayed" and not net.announce_maddrs:  # announce only relayed addresses that work
            slots = RelaySlots(p2p, relay.relays)
            await slots.first(cfg.timing.dht_start_timeout)
            peer.maddrs = await reachable(peer.peer_id, tuple(slots.maddrs(peer.peer_id)), cfg.timing.dht_start_timeout)
            log.info("reachable through relays", extra={"peer": peer.peer_id, "maddrs": peer.maddrs})
            tasks.append(asyncio.create_task(slots.run(stop, partial(_relayed, peer), peer.peer_id)))
        if net.direct_port is not None:
            limits_direct = DirectLimits(
                net.max_connections, net.max_caller_connections, net.handshake_timeout or cfg.timing.handshake_timeout
            )
            direct = DirectServer(servicer, store.credentials(), limits_direct, _admit(store), streams)
            port = await direct.start(net.host, net.direct_port)
            if relay.reached != "relayed":
                peer.direct_address = _direct_address(cfg, port)
            else:  # nobody outside can dial it: callers punch through to it, where its NAT allows
                puncher = await _punching(store, p2p, direct, model, relay, cfg.timing.handshake_timeout)
                if puncher is not None:
                    peer.punch_via = puncher.observers()
                    peer.punched = puncher.count
                    tasks.append(asyncio.create_task(puncher.run(stop)))
        if peer.network_mbps is None and net.initial_peers:
            await _estimate_link(peer, remote)
        if cfg.placement.blocks is not None:
            await peer.hold(cfg.placement.blocks, Role.SERVE)
        else:
            await peer.probe_speed()
            await peer.publish(PeerState.JOINING)
        tasks.append(asyncio.create_task(peer.heartbeat(stop)))
        tasks.append(asyncio.create_task(_expire_kept(compute, cfg.timing.activation_ttl / 4)))
        if cfg.placement.blocks is None:
            tasks.append(asyncio.create_task(run_follower(store, model.name, model.num_blocks, peer, cfg.timing)))
        if cfg.placement.broker:
            policy = Policy(replication=cfg.placement.replication, standby_fraction=cfg.placement.standby_fraction)
            planner = lambda peers: stage.plan(peers, policy)  # noqa: E731
            judge = BrokerJudge(store, remote, model.name, model.num_blocks, cfg.timing)
            broker = run_broker(store, model.name, planner, cfg.timing, judge.convicted)
            tasks += [asyncio.create_task(broker), asyncio.create_task(judge.run())]
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
        if puncher is not None:
            puncher.close()
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


async def _expire_kept(compute: ComputeService, period: float) -> None:
    """Kept forwards whose backward never came are dropped at their ttl even when no request comes to do it, and
    what the allocator holds free goes back to the system (``trim_freed_memory``)."""
    while True:
        await asyncio.sleep(period)
        compute.kept.expire()
        trim_freed_memory()


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
