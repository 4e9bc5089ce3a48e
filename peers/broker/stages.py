"""The broker's pure placement for a pre-training run: the model is cut into fixed pipeline stages (the run's
``[stages]``), each peer serves one whole stage, and peers are balanced so the slowest stage is as fast as it can be.

Unlike serving, a stage is never split or shifted: its replicas average their weights and optimizer state with each
other, which needs identical spans. A peer that already holds a stage keeps it (moving would mean downloading another
stage's state); newcomers go, fastest first, to the stage with the least throughput per block that their memory can
hold (ties: the earlier stage)."""

from __future__ import annotations

from peers.broker.planner import PeerInfo, Placement, PlacementPlan, Role, capacity
from swarm.ids import Span


def plan_stages(peers: list[PeerInfo], stages: tuple[Span, ...], block_bytes: int) -> PlacementPlan:
    num_blocks = stages[-1].end
    load = {s: 0.0 for s in stages}  # each stage's throughput per block
    placements: dict[str, Placement] = {}
    newcomers, unplaceable = [], []
    for p in peers:
        held = p.pinned or p.span
        if held in load and (p.pinned is not None or p.role == Role.SERVE):
            load[held] += min(p.throughput / len(held), p.link_tokens)
            placements[p.peer_id] = Placement(held, Role.SERVE)
        else:
            newcomers.append(p)
    for p in sorted(newcomers, key=lambda q: (-q.throughput, q.peer_id)):
        fits = [s for s in stages if capacity(p, num_blocks, block_bytes) >= len(s)]
        if not fits:
            unplaceable.append(p.peer_id)
            continue
        stage = min(fits, key=lambda s: (load[s], s.start))
        load[stage] += min(p.throughput / len(stage), p.link_tokens)
        placements[p.peer_id] = Placement(stage, Role.SERVE)
    total = sum(p.throughput for p in peers if p.peer_id in placements)
    return PlacementPlan(placements, min(load.values()), total / num_blocks, tuple(unplaceable))
