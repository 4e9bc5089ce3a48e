"""Fetching a trainable stage's state from the live peers that serve it (a joining replica, an export)."""

from __future__ import annotations

import logging

import torch

from swarm.client.remote import Remote
from swarm.client.routing import Hop
from swarm.errors import SwarmError
from swarm.ids import Span
from swarm.records import PeerState, ServerRecord

log = logging.getLogger(__name__)


def stage_servers(view, stage: Span, exclude: str | None = None) -> list[ServerRecord]:
    """Online peers serving exactly ``stage`` (replicas average only with identical spans)."""
    return [
        r
        for r in view.get(stage.start, [])
        if (r.start, r.end) == (stage.start, stage.end) and r.state == PeerState.ONLINE and r.peer_id != exclude
    ]


async def freshest_state(
    remote: Remote, records: list[ServerRecord], stage: Span, timeout: float
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(step, tensors) from whichever of ``records`` is furthest along; peers that fail are skipped."""
    best = None
    for r in records:
        try:
            got = await remote.compute(Hop.of(r, stage.start, stage.end), {"kind": "state", "start": 0, "end": 1}, {},
                                       timeout)  # fmt: skip
        except SwarmError as e:
            log.warning("peer %s did not send its state: %s", r.peer_id, e, extra={"span": str(stage)})
            continue
        step = int(got.pop("_step"))
        if best is None or step > best[0]:
            best = (step, got)
    return best
