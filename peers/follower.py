"""Applies the broker's assignments to this peer: only the newest (term, broker) it has seen, and only when its own
placement changed. A peer pinned with --blocks never follows; with no broker, a peer keeps what it has."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from peers.broker.planner import Role
from swarm.dht import RecordStore
from swarm.ids import Span, assignment_key
from swarm.lease import newest_assignment
from swarm.records import Assignment

log = logging.getLogger(__name__)


class Holder(Protocol):
    """What the follower moves: a peer's span and role."""

    @property
    def span(self) -> Span | None: ...

    @property
    def role(self) -> Role | None: ...

    async def hold(self, span: Span, role: Role) -> None: ...


async def run_follower(store: RecordStore, model_id: str, holder: Holder, period: float) -> None:
    me = store.peer_id
    seen: tuple[int, str] | None = None
    while True:
        await asyncio.sleep(period)
        try:
            plans = await asyncio.to_thread(store.read, assignment_key(model_id), Assignment)
            seen = newest_assignment(((a.term, a.broker) for a in plans), seen)
            current = [a for a in plans if (a.term, a.broker) == seen]
            if not current:
                continue  # we already obeyed something newer than anything visible now
            plan = max(current, key=lambda a: a.issued_at)  # the broker revises its plan within its term
            mine = plan.placements.get(me)
            if mine is None:
                continue
            span, role = mine.span, Role(mine.role)
            if (span, role) != (holder.span, holder.role):
                await holder.hold(span, role)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not apply the broker's assignment", extra={"peer": me})
