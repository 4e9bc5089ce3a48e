"""Applies the broker's assignments to this peer, when they are the broker's and harmless.

An assignment counts only when the holder of the lease this peer obeys signed it, for that term (``LeaseView``);
a forged lease or assignment changes nothing. Even then the peer keeps what it has when following would harm the
swarm: a span larger than its memory holds, leaving a block it serves with no other online server, or a plan that
demotes more than a quarter of the serving peers at once (``refusal``, pure). A peer pinned with --blocks never
follows; with no broker, a peer keeps what it has."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from peers.broker.planner import Role
from swarm.config import Timing
from swarm.dht import RecordStore, dht_time
from swarm.ids import Span, assignment_key, broker_key
from swarm.lease import LeaseRules, LeaseView
from swarm.records import Assignment, Lease, PeerState, View, servers

log = logging.getLogger(__name__)


class Holder(Protocol):
    """What the follower moves: a peer's span and role."""

    @property
    def span(self) -> Span | None: ...

    @property
    def role(self) -> Role | None: ...

    @property
    def max_blocks(self) -> int: ...

    async def hold(self, span: Span, role: Role) -> None: ...


def refusal(
    plan: Assignment, me: str, holder_span: Span | None, holder_role: Role | None, max_blocks: int, view: View
) -> str | None:
    """Why following ``plan`` would harm the swarm (None: it would not)."""
    mine = plan.placements[me]
    if len(mine.span) > max_blocks:
        return f"{len(mine.span)} blocks, more than this peer's {max_blocks}"
    online = [r.peer_id for r in servers(view).values() if r.state == PeerState.ONLINE]
    demoted = [p for p in online if (pl := plan.placements.get(p)) is not None and pl.role == Role.STANDBY.value]
    if len(demoted) > max(1, len(online) // 4):
        return f"it demotes {len(demoted)} of {len(online)} serving peers at once"
    if holder_span is not None and holder_role == Role.SERVE:
        kept = mine.span if mine.role == Role.SERVE.value else None
        left = [b for b in holder_span if kept is None or b not in kept]

        def stays(peer_id: str, block: int) -> bool:  # still serving ``block`` once the plan is followed
            pl = plan.placements.get(peer_id)
            return pl is None or (pl.role == Role.SERVE.value and block in pl.span)

        # Another server must be online there now and stay there under the plan: two peers that each see the other
        # would otherwise both leave a block at once (make before break: a peer moved in must be online first).
        uncovered = [
            b
            for b in left
            if not any(r.peer_id != me and r.state == PeerState.ONLINE and stays(r.peer_id, b) for r in view[b])
        ]
        if uncovered:
            return f"blocks {uncovered[0]}-{uncovered[-1]} would have no other server"
    return None


async def run_follower(store: RecordStore, model_id: str, num_blocks: int, holder: Holder, timing: Timing) -> None:
    me = store.peer_id
    leases = LeaseView(LeaseRules(timing.lease_seconds, timing.max_tenure, skew=timing.clock_skew))
    while True:
        await asyncio.sleep(timing.broker_period)
        try:
            move = await asyncio.to_thread(_follow_once, store, model_id, num_blocks, holder, leases, me)
            if move is not None:
                await holder.hold(*move)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not apply the broker's assignment", extra={"peer": me})


def _follow_once(
    store: RecordStore, model_id: str, num_blocks: int, holder: Holder, leases: LeaseView, me: str
) -> tuple[Span, Role] | None:
    """Read the leases and assignments: the move this peer should make, if any."""
    leases.resolve(store.read(broker_key(model_id), Lease), dht_time())
    plans = [a for a in store.read(assignment_key(model_id), Assignment) if leases.obeys(a)]
    if not plans:
        return None
    plan = max(plans, key=lambda a: a.issued_at)  # the broker revises its plan within its term
    mine = plan.placements.get(me)
    if mine is None or (mine.span, Role(mine.role)) == (holder.span, holder.role):
        return None
    why = refusal(plan, me, holder.span, holder.role, holder.max_blocks, store.view(model_id, num_blocks))
    if why is not None:
        log.warning("keeping what it has: the broker's plan is harmful (%s)", why, extra={"peer": me})
        return None
    return mine.span, Role(mine.role)
