"""The broker role, run by every candidate peer: stand in the election each period and, while holding the lease,
read the peers' heartbeats, plan, and publish the assignment stamped with the term."""

from __future__ import annotations

import asyncio
import logging
import math

from hivemind.utils import get_dht_time

from peers.broker.election import Election, Lease
from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm
from peers.broker.stages import plan_stages
from swarm.dht import read_all, store_own
from swarm.ids import assignment_key, broker_key, peers_key
from swarm.records import Assignment, PeerRecord, PeerState, parse_as

log = logging.getLogger(__name__)


class DhtLeaseStore:
    """Leases under the model's broker key, each candidate in its own signed subkey."""

    def __init__(self, peer) -> None:
        self.peer = peer

    def read(self) -> list[Lease]:
        out = []
        for value in read_all(self.peer.dht, broker_key(self.peer.model.name)):
            if isinstance(value, dict) and {"term", "holder", "expires"} <= set(value):
                out.append(Lease(int(value["term"]), str(value["holder"]), float(value["expires"])))
        return out

    def write(self, lease: Lease) -> None:
        value = {"term": lease.term, "holder": lease.holder, "expires": lease.expires}
        # the DHT keeps the record long after the lease lapses, so everyone still sees the last term used
        retention = lease.expires + 100 * self.peer.cfg.timing.lease_seconds
        store_own(self.peer.dht, self.peer.validator, broker_key(self.peer.model.name), value, retention)


def live_peers(records: list[PeerRecord], now: float, heartbeat_timeout: float) -> list[PeerInfo]:
    """Peers whose heartbeat is fresh (a crash is noticed by missed heartbeats, long before records expire)."""
    out = []
    for r in records:
        if r.state == PeerState.LEAVING or now - r.updated_at > heartbeat_timeout:
            continue
        role = Role.SERVE if r.state == PeerState.ONLINE else Role.STANDBY if r.state == PeerState.STANDBY else None
        link = math.inf
        if r.network_mbps and r.token_bytes:  # every token crosses the link twice: into and out of the span
            link = r.network_mbps * 1e6 / 8 / (2 * r.token_bytes)
        pinned = r.span if r.pinned else None
        out.append(PeerInfo(r.peer_id, r.block_throughput, r.memory, pinned, r.span, role, link_tokens=link))
    return out


def plan_once(peer, term: int) -> Assignment:
    values = read_all(peer.dht, peers_key(peer.model.name))
    records = [r for r in (parse_as(PeerRecord, v) for v in values) if r is not None]
    now = get_dht_time()
    peers = live_peers(records, now, peer.cfg.timing.heartbeat_timeout)
    per_block = max(peer.model.block_bytes, 1)
    policy = Policy(replication=peer.cfg.replication, standby_fraction=peer.cfg.standby_fraction)
    run = getattr(peer.model, "run", None)  # a pre-training run: whole stages, balanced (peers/broker/stages.py)
    if run is not None:
        plan = plan_stages(peers, run.stages, per_block)
    else:
        plan = plan_swarm(peers, peer.model.num_blocks, per_block, policy)
    placements = {
        pid: (pl.span.start, pl.span.end, pl.role.value)
        for pid, pl in plan.placements.items()
        if not any(p.peer_id == pid and p.pinned for p in peers)
    }
    return Assignment(term=term, broker=peer.peer_id, issued_at=now, placements=placements)


async def run_broker(peer) -> None:
    timing = peer.cfg.timing
    election = Election(peer.peer_id, DhtLeaseStore(peer), get_dht_time, timing.lease_seconds)
    while True:
        try:
            lease = await asyncio.to_thread(election.tick)
            if lease is not None:
                assignment = await asyncio.to_thread(plan_once, peer, lease.term)
                await asyncio.to_thread(
                    store_own,
                    peer.dht,
                    peer.validator,
                    assignment_key(peer.model.name),
                    assignment.model_dump(mode="json"),
                    lease.expires,
                )
                log.debug("broker published a plan", extra={"peer": peer.peer_id})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("broker round failed", extra={"peer": peer.peer_id})
        await asyncio.sleep(timing.broker_period)
