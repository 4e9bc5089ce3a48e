"""The broker role, run by every candidate peer: stand in the election each period and, while holding the lease,
read the peers' heartbeats, plan, and publish the assignment stamped with the term. Servers convicted of wrong
answers (``peers.judge``, injected by the node) are left out of the plan."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from peers.broker.election import Election
from peers.broker.planner import PeerInfo, PlacementPlan, Role
from swarm.config import Timing
from swarm.dht import RecordStore, dht_time
from swarm.ids import assignment_key, broker_key
from swarm.lease import LeaseRules
from swarm.perf.model import Link
from swarm.perf.placement import link_tokens
from swarm.records import Assignment, Lease, PeerRecord, PeerState, Placement

log = logging.getLogger(__name__)
Planner = Callable[[list[PeerInfo]], PlacementPlan]  # the stage's placement of the live peers (pure)
Convicted = Callable[[], frozenset[str]]  # servers convicted of wrong answers so far (``peers.judge``)


class DhtLeaseStore:
    """Leases under the model's broker key, each candidate in its own signed subkey."""

    def __init__(self, store: RecordStore, model_id: str, lease_seconds: float) -> None:
        self.store, self.key, self.lease_seconds = store, broker_key(model_id), lease_seconds

    def read(self) -> list[Lease]:
        return self.store.read(self.key, Lease)

    def write(self, lease: Lease) -> None:
        # the DHT keeps the record long after the lease lapses, so everyone still sees the last term used
        self.store.publish(self.key, lease, lease.expires + 100 * self.lease_seconds)


def live_peers(records: list[PeerRecord], now: float, heartbeat_timeout: float, skew: float) -> list[PeerInfo]:
    """Peers whose heartbeat is fresh (a crash is noticed by missed heartbeats, long before records expire); one
    dated in the future is refused (it would never go stale), and one joining that has not measured its speed yet
    waits."""
    out = []
    for r in records:
        if r.state == PeerState.LEAVING or not -skew <= now - r.updated_at <= heartbeat_timeout:
            continue
        if r.state == PeerState.JOINING and r.block_throughput <= 0:
            continue  # not measured yet (a peer behind NAT heartbeats before it holds its relay slots)
        role = Role.SERVE if r.state == PeerState.ONLINE else Role.STANDBY if r.state == PeerState.STANDBY else None
        link = math.inf
        if r.network_mbps and r.token_bytes:  # every token crosses the link twice: into and out of the span
            link = link_tokens(Link(bandwidth=r.network_mbps * 1e6 / 8), r.token_bytes)
        pinned = r.span if r.pinned else None
        out.append(
            PeerInfo(
                r.peer_id,
                r.block_throughput,
                r.memory,
                pinned,
                r.span,
                role,
                link_tokens=link,
                block_bytes=r.block_bytes,
            )
        )
    return out


def plan_once(
    store: RecordStore,
    model_id: str,
    planner: Planner,
    me: str,
    term: int,
    timing: Timing,
    convicted: frozenset[str] = frozenset(),
) -> Assignment:
    records = store.heartbeats(model_id)
    now = dht_time()
    live = live_peers(records, now, timing.heartbeat_timeout, timing.clock_skew)
    peers = [p for p in live if p.peer_id not in convicted]  # placed nowhere: not counted, not a standby
    plan = planner(peers)
    # Only the moves: a peer the plan leaves where its heartbeat says it is (and a pinned one) is not named, and a
    # follower not named stays (``peers.follower``). Every server reads the assignment each broker period: one that
    # named every peer would cost each of N servers O(N) bytes a period.
    held = {p.peer_id: (p.span, p.role) for p in peers}
    pinned = {p.peer_id for p in peers if p.pinned}
    placements = {
        pid: Placement(start=pl.span.start, end=pl.span.end, role=pl.role.value)
        for pid, pl in plan.placements.items()
        if pid not in pinned and held.get(pid) != (pl.span, pl.role)
    }
    shunned = tuple(sorted(p.peer_id for p in live if p.peer_id in convicted))[:1024]
    return Assignment(term=term, broker=me, issued_at=now, placements=placements, shunned=shunned)


async def run_broker(
    store: RecordStore, model_id: str, planner: Planner, timing: Timing, convicted: Convicted | None = None
) -> None:
    me = store.peer_id
    rules = LeaseRules(timing.lease_seconds, timing.max_tenure, skew=timing.clock_skew)
    election = Election(me, DhtLeaseStore(store, model_id, timing.lease_seconds), dht_time, rules)
    while True:
        try:
            lease = await asyncio.to_thread(election.tick)
            if lease is not None:
                shunned = convicted() if convicted is not None else frozenset()
                assignment = await asyncio.to_thread(
                    plan_once, store, model_id, planner, me, lease.term, timing, shunned
                )
                await asyncio.to_thread(store.publish, assignment_key(model_id), assignment, lease.expires)
                log.debug("broker published a plan", extra={"peer": me})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("broker round failed", extra={"peer": me})
        await asyncio.sleep(timing.broker_period)
