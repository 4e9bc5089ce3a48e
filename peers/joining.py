"""A peer joining the swarm, and where others reach it: its DHT (joined again as a private peer when its
reachability, measured, says it is behind a NAT), the addresses its records announce, who may call it, whom it
chains with, hole punching for its direct plane, and its link estimate. ``join`` is ``peers.run``'s first phase."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, replace

from hivemind.p2p import P2P

from peers.config import NetworkConfig, PeerConfig
from peers.hardware import estimate_link_mbps
from peers.reach import measure
from peers.rpc.direct_server import DirectServer
from peers.rpc.directory import ServerDirectory
from peers.rpc.edge import Admit
from peers.rpc.punch_server import Puncher
from peers.serving.stage_port import ModelInfo
from swarm import wire
from swarm.dht import RecordStore, start_dht
from swarm.membership import SwarmKey, swarm_key_for
from swarm.protocol import RPC_PUNCH
from swarm.records import OBSERVER, servers
from swarm.relay import RelayPolicy, relay_peer
from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Joined:
    """A peer in the swarm's DHT: its store, and its network settings as measured (``relay``: how it is reached)."""

    store: RecordStore
    net: NetworkConfig
    relay: RelayPolicy


async def join(cfg: PeerConfig, model: ModelInfo) -> Joined:
    """This peer's DHT, joined as its reachability says (``--reachability auto``: measured once joined; behind a NAT
    it joins again as a private peer, its DHT in client mode). The DHT forks a child: a peer joins before torch
    starts its thread pools and before the weights fill memory."""
    net = cfg.network
    swarm_key = swarm_key_for(net.swarm_key, new_swarm=net.new_swarm)
    relay = net.relay_policy()
    store = _start(net, relay, cfg, swarm_key)
    if net.reachability == "auto" and net.initial_peers and not net.announce_maddrs:
        try:
            net, relay = await _measured(net, store, model, cfg.timing.handshake_timeout)
        except BaseException:
            store.shutdown()
            raise
        if relay.reached == "relayed":
            store.shutdown()
            store = _start(net, relay, cfg, swarm_key)
    return Joined(store, net, relay)


def _start(net: NetworkConfig, relay: RelayPolicy, cfg: PeerConfig, swarm_key: SwarmKey | None) -> RecordStore:
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
    if measured is not None:  # "public" or "private"
        net = replace(net, reachability="public" if measured == "public" else "private")
    return net, net.relay_policy()


def announced_maddrs(joined: Joined) -> tuple[str, ...]:
    """The addresses this peer's records announce: those given, its relayed ones when private (what p2pd listens
    on is unreachable then), else what p2pd reports."""
    net, relay, store = joined.net, joined.relay, joined.store
    if relay.reached == "relayed" and not net.announce_maddrs:
        return tuple(relay.relayed_maddrs(store.peer_id))
    return tuple(
        m if "/p2p/" in m else f"{m}/p2p/{store.peer_id}" for m in (net.announce_maddrs or store.visible_maddrs())
    )


def direct_address(net: NetworkConfig, port: int) -> str | None:
    """Where others should dial the TCP data plane: the listen host, or the announced IP behind a wildcard."""
    host = net.host
    if host in ("0.0.0.0", "::"):
        announced = [m.split("/")[2] for m in net.announce_maddrs if m.startswith(("/ip4/", "/ip6/"))]
        if not announced:
            return None  # nobody could dial a wildcard address; libp2p only
        host = announced[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def admit_of(store: RecordStore) -> Admit | None:
    """Who may call this peer's RPCs: anyone in an open swarm (None), holders of its key in a private one."""
    key = store.swarm_key
    return key.admits if key is not None else None


def directory_of(store: RecordStore, model: ModelInfo, ttl: float) -> ServerDirectory:
    """The servers of this model with our weights, from their signed records: whom chaining trusts."""
    return ServerDirectory(
        lambda shard: store.shard(model.name, shard),
        model.chain_fingerprints,
        model.num_blocks,
        ttl,
    )


async def punching(joined: Joined, p2p: P2P, direct: DirectServer, model: ModelInfo, timeout: float) -> Puncher | None:
    """Hole punching for a peer behind NAT, observed through its relays' direct planes (their records say where),
    or None where none answers (callers then stay on the relayed path).

    Two observers tell a symmetric NAT (which no punch gets through) by the two ports they see; with one, the peer
    cannot tell and offers punches that fail. So the relays' records are read again, for at most two ``timeout``s,
    until two of them are seen (a read of a loaded DHT can miss one: a peer behind a symmetric NAT then offered
    punching and its callers' punches failed)."""
    store = joined.store
    relays = {relay_peer(r) for r in joined.relay.relays}
    want = min(len(relays), 2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2 * timeout
    observers = await _observers(store, model, relays)
    while len(observers) < want and loop.time() < deadline:
        await asyncio.sleep(min(1.0, timeout))
        observers = await _observers(store, model, relays)
    log.info("observed by %d of its relays", len(observers), extra={"observers": observers})
    puncher = Puncher(direct, store.credentials(), lambda: observers, admit_of(store), timeout)
    if not observers or not await puncher.refresh():
        log.warning("no hole punching: no relay's direct plane told this peer its address")
        return None
    await p2p.add_protobuf_handler(RPC_PUNCH, puncher.rpc_punch, wire.Frame)
    return puncher


async def _observers(store: RecordStore, model: ModelInfo, relays: set[str | None]) -> tuple[str, ...]:
    """The direct planes of this peer's relays that their records name (at most 4)."""
    records = servers(await asyncio.to_thread(store.view, model.name, model.num_blocks)).values()
    return tuple(
        f"{r.peer_id}@{r.direct_address}"
        for r in records
        if r.peer_id in relays and r.direct_address and re.match(OBSERVER, f"{r.peer_id}@{r.direct_address}")
    )[:4]


async def estimate_link(cfg: PeerConfig, store: RecordStore, model: ModelInfo, remote: Remote) -> float | None:
    """This peer's link in Mbit/s: declared, or estimated once by timing probes to other servers (None: unknown)."""
    declared = cfg.network.network_mbps
    if declared is not None or not cfg.network.initial_peers:
        return declared
    try:
        view = await asyncio.to_thread(store.view, model.name, model.num_blocks)
        net, timing = cfg.network, cfg.timing
        mbps = await estimate_link_mbps(
            remote, list(servers(view).values()), store.peer_id, net.probe_bytes, timing.probe_timeout
        )
        log.info("link estimate %s Mbit/s", f"{mbps:.0f}" if mbps else "unknown", extra={"peer": store.peer_id})
        return mbps
    except Exception:
        log.warning("could not estimate the link", extra={"peer": store.peer_id})
        return None
