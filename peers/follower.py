"""Applies the broker's assignments to this peer: only the newest (term, broker) it has seen, and only when its own
placement changed. A peer pinned with --blocks never follows; with no broker, a peer keeps what it has."""

from __future__ import annotations

import asyncio
import logging

from peers.broker.election import newest_assignment
from peers.broker.planner import Role
from swarm.dht import read_all
from swarm.ids import Span, assignment_key
from swarm.records import Assignment, parse_as

log = logging.getLogger(__name__)


async def run_follower(peer) -> None:
    seen: tuple[int, str] | None = None
    while True:
        await asyncio.sleep(peer.cfg.timing.broker_period)
        try:
            values = await asyncio.to_thread(read_all, peer.dht, assignment_key(peer.model.name))
            plans = [a for a in (parse_as(Assignment, v) for v in values) if a is not None]
            seen = newest_assignment(((a.term, a.broker) for a in plans), seen)
            current = [a for a in plans if (a.term, a.broker) == seen]
            if not current:
                continue  # we already obeyed something newer than anything visible now
            plan = max(current, key=lambda a: a.issued_at)  # the broker revises its plan within its term
            mine = plan.placements.get(peer.peer_id)
            if mine is None:
                continue
            start, end, role = mine
            span, role = Span(start, end), Role(role)
            if (span, role) != (peer.span, peer.role):
                await peer.hold(span, role)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not apply the broker's assignment", extra={"peer": peer.peer_id})
