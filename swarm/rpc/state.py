"""Fetching a trainable stage's state from the live peers that serve it (a joining replica, an export)."""

from __future__ import annotations

import logging

from swarm.errors import SwarmError
from swarm.ids import Span
from swarm.records import ServerRecord
from swarm.rpc.hop import Hop
from swarm.rpc.remote import Remote, Tensors

log = logging.getLogger(__name__)


async def freshest_state(
    remote: Remote, records: list[ServerRecord], stage: Span, timeout: float, max_bytes: int
) -> tuple[int, Tensors] | None:
    """(step, tensors) from whichever of ``records`` is furthest along; peers that fail are skipped. ``max_bytes``
    bounds one peer's reply (what the stage's weights and two Adam moments take, with room for the framing)."""
    best: tuple[int, Tensors] | None = None
    for r in records:
        try:
            reply, tensors = await remote.state(Hop.of(r, stage.start, stage.end), timeout, max_bytes)
        except SwarmError as e:
            log.warning("did not send its state: %s", e, extra={"peer": r.peer_id, "span": str(stage)})
            continue
        if (reply.start, reply.end) != (stage.start, stage.end):
            log.warning("sent the state of another stage", extra={"peer": r.peer_id, "span": str(stage)})
            continue
        if best is None or reply.step > best[0]:
            best = (reply.step, tensors)
    return best
