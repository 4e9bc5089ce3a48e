"""The broker's pure planner: (swarm view, model, policy) -> assignment of spans to peers.

Model of the swarm: a peer with throughput t (blocks per unit time) serving a span of L blocks adds t / L to the
throughput of each block of its span; the swarm's throughput is its bottleneck, the smallest total over all blocks,
and can be no more than (sum of t) / (number of blocks). A peer holds at most memory // block_bytes blocks.

A slow link caps a peer: it passes at most ``link_tokens`` tokens per unit time whatever its compute, so its share
of each block is min(t / L, link_tokens); such a peer is worth most on a long span.

The plan: pinned peers stay where they are; peers that already serve keep their span unless moving raises the
bottleneck by more than the hysteresis; a standby whose preloaded span covers a hole is promoted before anyone
loads from disk; new peers take the window where blocks are weakest, using all the memory they offer; local-search
rounds then move peers while that raises the bottleneck; finally the weakest peers beyond the replication need
become standbys holding the most fragile spans. "Weakest" is tried two ways, keeping the better final bottleneck (the
first on ties): the most sum of 1 / throughput over the window, and Petals' rule (the window whose sorted throughputs
are smallest, i.e. the weakest block covered first). A peer's share comes from ``swarm.perf.placement.peer_rate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from swarm.ids import Span
from swarm.perf.placement import peer_rate


class Role(StrEnum):
    SERVE = "serve"
    STANDBY = "standby"


@dataclass(frozen=True)
class PeerInfo:
    peer_id: str
    throughput: float  # blocks per unit time
    memory: int  # bytes available for blocks
    pinned: Span | None = None  # --blocks: counted, never moved
    span: Span | None = None  # what it holds now (serving or preloaded)
    role: Role | None = None  # what it does with it now
    link_tokens: float = math.inf  # tokens per unit time its network link can carry in and out (inf: unknown)
    block_bytes: int = 0  # what one block takes in the format it serves (quantized: less); 0: the model's count


@dataclass(frozen=True)
class Policy:
    replication: int = 1  # each block served by at least this many peers where possible
    standby_fraction: float = 0.1  # of the unpinned peers, kept back as standbys once replication is met
    hysteresis: float = 0.1  # a serving peer moves only if the bottleneck rises by this fraction
    rounds: int = 3  # local-search passes


@dataclass(frozen=True)
class Placement:
    span: Span
    role: Role


@dataclass(frozen=True)
class PlacementPlan:
    """Where each peer goes (span and role), and how fast the swarm it makes serves (its bottleneck and bound)."""

    placements: dict[str, Placement] = field(default_factory=dict)
    bottleneck: float = 0.0
    upper_bound: float = 0.0
    unplaceable: tuple[str, ...] = ()  # peers without memory for one block

    def moves_from(self, peers: list[PeerInfo]) -> int:
        """How many peers must load something new to follow this plan."""
        return sum(1 for p in peers if p.peer_id in self.placements and self.placements[p.peer_id].span != p.span)


def settled(peers: list[PeerInfo], plan: PlacementPlan) -> list[PeerInfo]:
    """The peers as they will be once they have followed ``plan`` (for simulations and tests of replanning)."""
    out = []
    for p in peers:
        pl = plan.placements.get(p.peer_id)
        out.append(
            PeerInfo(
                p.peer_id,
                p.throughput,
                p.memory,
                p.pinned,
                pl.span if pl else None,
                pl.role if pl else None,
                block_bytes=p.block_bytes,
            )
        )
    return out


def capacity(peer: PeerInfo, num_blocks: int, block_bytes: int) -> int:
    """Blocks ``peer`` can hold: its memory over what one block takes in its own format (``block_bytes``: the
    model's, for a peer that did not say)."""
    return min(num_blocks, peer.memory // max(peer.block_bytes or block_bytes, 1))


Share = Callable[[str, int], float]  # (peer, span length) -> what the peer adds to each block of such a span


def _totals(num_blocks: int, spans: dict[str, Span], share: Share) -> list[float]:
    totals = [0.0] * num_blocks
    for pid, span in spans.items():
        each = share(pid, len(span))
        for b in range(span.start, span.end):
            totals[b] += each
    return totals


def _best_window(totals: list[float], length: int, share: float) -> Span:
    """The window that most raises the weakest blocks: maximise the sum of 1 / total over the window, i.e. cover
    the blocks where each unit of throughput matters most (holes first)."""
    n = len(totals)
    weights = [1.0 / (t + share * 1e-3 + 1e-12) for t in totals]
    best, best_score, acc = 0, -1.0, sum(weights[:length])
    for s in range(0, n - length + 1):
        if s:
            acc += weights[s + length - 1] - weights[s - 1]
        if acc > best_score * (1 + 1e-12):
            best, best_score = s, acc
    return Span(best, best + length)


def _weakest_window(totals: list[float], length: int, share: float = 0.0) -> Span:
    """The window whose blocks, sorted from the weakest, are weakest (Petals' ``choose_best_blocks`` rule): it covers
    the weakest block first, then the next weakest, and so on; the first such window on ties."""
    # a sorted window starts with its minimum: only windows holding a weakest block of all can win
    low, last = min(totals), len(totals) - length
    starts = sorted(
        {s for i, t in enumerate(totals) if t == low for s in range(max(i - length + 1, 0), min(i, last) + 1)}
    )
    best = min(starts, key=lambda s: sorted(totals[s : s + length]))
    return Span(best, best + length)


def _add(totals: list[float], span: Span, share: float) -> None:
    for b in range(span.start, span.end):
        totals[b] += share


def plan_swarm(peers: list[PeerInfo], num_blocks: int, block_bytes: int, policy: Policy = Policy()) -> PlacementPlan:
    speed = {p.peer_id: max(p.throughput, 1e-9) for p in peers}
    link = {p.peer_id: p.link_tokens for p in peers}

    def share(pid: str, length: int) -> float:
        """What a peer adds to each block of a span of ``length`` blocks (the performance model's throughput rule:
        compute and transfers overlap, the slower bounds the peer)."""
        return peer_rate(speed[pid], length, link[pid])

    cap = {p.peer_id: capacity(p, num_blocks, block_bytes) for p in peers}
    unplaceable = tuple(p.peer_id for p in peers if cap[p.peer_id] < 1 and p.pinned is None)
    spans: dict[str, Span] = {}
    for p in peers:
        if p.pinned is not None:
            spans[p.peer_id] = p.pinned
        elif p.span is not None and p.role == Role.SERVE and len(p.span) <= cap[p.peer_id]:
            spans[p.peer_id] = p.span
    totals = _totals(num_blocks, spans, share)

    # holes first: promote standbys whose preloaded span covers a block nobody serves
    for p in sorted(peers, key=lambda q: -speed[q.peer_id]):
        if p.peer_id in spans or p.role != Role.STANDBY or p.span is None or len(p.span) > cap[p.peer_id]:
            continue
        if any(totals[b] == 0 for b in range(p.span.start, p.span.end)):
            spans[p.peer_id] = p.span
            _add(totals, p.span, share(p.peer_id, len(p.span)))

    # two constructions, each followed by the local search: the window maximising the sum of 1 / throughput, and
    # Petals' rule (the weakest block first); the better final bottleneck wins, the first on ties
    free = [p for p in peers if p.peer_id not in spans and cap[p.peer_id] >= 1 and p.pinned is None]
    placed = set(spans) | {p.peer_id for p in free}
    movable = [p for p in peers if p.pinned is None and p.peer_id in placed]
    # each peer's most: its compute, or its link times the blocks it can hold, whichever is smaller
    bound = sum(min(speed[p.peer_id], link[p.peer_id] * cap[p.peer_id]) for p in peers if cap[p.peer_id] >= 1)
    best: PlacementPlan | None = None
    for window in (_best_window, _weakest_window):
        found, found_totals = _search(dict(spans), list(totals), free, movable, cap, speed, share, policy, window)
        placements = {pid: Placement(span, Role.SERVE) for pid, span in found.items()}
        placements = _choose_standbys(peers, placements, found_totals, speed, policy)
        serving = {pid: pl.span for pid, pl in placements.items() if pl.role == Role.SERVE}
        final = _totals(num_blocks, serving, share)
        plan = PlacementPlan(placements, min(final) if final else 0.0, bound / max(num_blocks, 1), unplaceable)
        if best is None or plan.bottleneck > best.bottleneck * (1 + 1e-9) + 1e-12:
            best = plan
    assert best is not None
    return best


Window = Callable[[list[float], int, float], Span]  # (block totals, span length, the peer's share) -> where


def _search(
    spans: dict[str, Span],
    totals: list[float],
    free: list[PeerInfo],
    movable: list[PeerInfo],
    cap: dict[str, int],
    speed: dict[str, float],
    share: Share,
    policy: Policy,
    window: Window,
) -> tuple[dict[str, Span], list[float]]:
    """Place the ``free`` peers, strongest first, at the ``window`` their memory allows, then move peers while that
    raises the bottleneck (or, at equal bottleneck, lowers the count of weakest blocks); peers that already held their
    span must gain more than the hysteresis to move. Updates and returns ``spans`` and ``totals``."""
    for p in sorted(free, key=lambda q: -speed[q.peer_id]):
        length = cap[p.peer_id]
        each = share(p.peer_id, length)
        span = window(totals, length, each)
        spans[p.peer_id] = span
        _add(totals, span, each)
    for _ in range(policy.rounds):
        changed = False
        for p in sorted(movable, key=lambda q: speed[q.peer_id]):
            old = spans[p.peer_id]
            each = share(p.peer_id, len(old))
            before = min(totals)
            weak_before = _weak(totals, before)
            _add(totals, old, -each)
            candidate = window(totals, len(old), each)
            _add(totals, candidate, each)
            after = min(totals)
            if p.span == old:  # it already holds this span: moving costs a reload, so demand a real gain
                better = after > before * (1 + policy.hysteresis) + 1e-12
            else:
                better = after > before + 1e-12 or (after >= before - 1e-12 and _weak(totals, after) < weak_before)
            if candidate != old and better:
                spans[p.peer_id] = candidate
                changed = True
            else:
                _add(totals, candidate, -each)
                _add(totals, old, each)
        if not changed:
            break
    return spans, totals


def _weak(totals: list[float], level: float) -> int:
    return sum(1 for t in totals if t <= level + 1e-12)


def _choose_standbys(
    peers: list[PeerInfo],
    placements: dict[str, Placement],
    totals: list[float],
    speed: dict[str, float],
    policy: Policy,
) -> dict[str, Placement]:
    """The weakest unpinned peers become standbys while every block keeps ``replication`` serving peers; a standby
    preloads the most fragile window (fewest serving replicas) of its length."""
    unpinned = sorted(
        (p for p in peers if p.pinned is None and p.peer_id in placements), key=lambda q: speed[q.peer_id]
    )
    want = math.floor(len(unpinned) * policy.standby_fraction)
    if want == 0:
        return placements
    n = len(totals)
    replicas = [0] * n
    for pl in placements.values():
        for b in range(pl.span.start, pl.span.end):
            replicas[b] += 1
    out = dict(placements)
    chosen = 0
    for p in unpinned:
        if chosen >= want:
            break
        span = out[p.peer_id].span
        if any(replicas[b] - 1 < policy.replication for b in range(span.start, span.end)):
            continue  # it is needed to keep the replication
        for b in range(span.start, span.end):
            replicas[b] -= 1
        out[p.peer_id] = Placement(span, Role.STANDBY)
        chosen += 1
    # point each standby at the most fragile window of its length (fewest serving replicas)
    for pid, pl in list(out.items()):
        if pl.role != Role.STANDBY:
            continue
        length = len(pl.span)
        fragile = _best_window([float(r) for r in replicas], length, 1.0)
        if (peer := next(p for p in peers if p.peer_id == pid)).span == pl.span and peer.role == Role.STANDBY:
            fragile = pl.span  # already preloaded: keep it warm rather than reload
        out[pid] = Placement(fragile, Role.STANDBY)
    return out
