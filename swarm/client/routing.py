"""Pure routing: from a swarm view to a chain of servers covering blocks ``start:end``.

Shortest path over block boundaries, where a hop through server s from boundary a to boundary b costs what the
performance model prices one hop at (``swarm.perf.placement.hop_seconds``: s's measured round trip where the client
has one, else the prior; the call's bytes, through the codec, over s's announced bandwidth; the software's fixed
cost per hop; once per hop chained, there and back client-mediated) plus (b - a) blocks at s's speed (measured by
the client where it can, claimed otherwise). Servers may overlap and be entered mid-span.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Literal

from swarm.errors import MissingBlocksError
from swarm.hop import Hop
from swarm.perf.placement import RouteCosts
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import Capability, PeerState, ServerRecord, View, servers

Mode = Literal["inference", "forward"]


def pick_fingerprint(
    view: View, accepted: frozenset[str] | None = None, groups: Mapping[str, str] | None = None
) -> frozenset[str] | None:
    """The weights to chain: of the ``accepted`` fingerprints (None: any), the group covering the most blocks, then
    with the most throughput. ``groups`` (fingerprint -> group) names fingerprints that may share a chain: the same
    weights and dtype in the formats a client allowed (``swarm.quantization``); any other fingerprint is a group of
    its own. With none of the accepted weights served, one of them all the same (so that no other weights become
    eligible)."""
    groups = groups or {}
    best: frozenset[str] | None = None
    if accepted:
        first = min(accepted)
        best = frozenset(fp for fp in accepted if groups.get(fp, fp) == groups.get(first, first))
    best_score = -1.0
    by_group: dict[str, list[ServerRecord]] = {}
    for r in servers(view).values():
        if r.state == PeerState.ONLINE and r.protocol_version == PROTOCOL_VERSION:
            if accepted is not None and r.fingerprint not in accepted:
                continue
            by_group.setdefault(groups.get(r.fingerprint, r.fingerprint), []).append(r)
    for group, recs in by_group.items():
        covered: set[int] = set()
        for r in recs:
            covered.update(range(r.start, r.end))
        score = len(covered) * 1e9 + sum(r.forward_tps for r in recs)
        if score > best_score:
            members = {fp for fp, g in groups.items() if g == group} | {r.fingerprint for r in recs}
            best, best_score = frozenset(members), score
    return best


def eligible(
    view: View,
    *,
    fingerprint: str | frozenset[str] | None,
    banned: frozenset[str] = frozenset(),
    min_cache_tokens: int = 0,
    needs: frozenset[Capability] = frozenset(),
) -> list[ServerRecord]:
    """Servers a route may use: online, speaking this protocol, serving the chosen weights, not banned, with room,
    and whose runtime can do what the route ``needs`` (a training forward needs ``backward``, a LoRA or prompt route
    ``adapters``; an ONNX server has neither). ``fingerprint``: the weights chosen (one, or a group that may
    share a chain: ``pick_fingerprint``)."""
    chosen = frozenset({fingerprint}) if isinstance(fingerprint, str) else fingerprint
    return [
        r
        for r in servers(view).values()
        if r.state == PeerState.ONLINE
        and r.protocol_version == PROTOCOL_VERSION
        and (chosen is None or r.fingerprint in chosen)
        and r.peer_id not in banned
        and r.cache_tokens_free >= min_cache_tokens
        and needs <= r.capabilities
    ]


def choose_route(
    records: list[ServerRecord],
    start: int,
    end: int,
    *,
    mode: Mode = "inference",
    measured: Mapping[str, float] | None = None,
    default_latency: float = 0.003,
    model_id: str = "",
    noise: Mapping[str, float] | None = None,
    rtt: Mapping[str, float] | None = None,
    costs: RouteCosts | None = None,
    load: Mapping[str, float] | None = None,
) -> list[Hop]:
    """Cheapest chain covering ``start:end``; ``mode`` picks which speed prices a block: the client's own
    measurement of a server where it has one (``measured``: seconds per block per step or token, network included),
    else what the server claims. A server is believed only until it has been measured.

    ``noise`` (peer -> factor) scales each server's cost: with independent Exp(1) factors, a choice between replicas
    falls to each with probability proportional to its speed (SWARM's stochastic wiring of training micro-batches).

    A hop's network and software are priced by the performance model with ``costs`` (default: a flat
    ``default_latency`` per unmeasured hop, client-mediated, bytes not priced; the live client passes its real ones,
    ``SwarmView.costs``), ``rtt`` (peer -> measured round trip in seconds) and each server's announced
    ``network_mbps``. A forward's blocks cost their speed times ``costs.tokens``; an inference step's, one step.
    ``load`` (peer -> factor >= 1) scales a server's compute, not its network: a new session's share of a busy one."""
    measured, noise, rtt, load = measured or {}, noise or {}, rtt or {}, load or {}
    costs = costs or RouteCosts.from_prior(default_latency)
    block_cost = _block_pricer(records, mode, measured, costs, explore=bool(noise or load))
    prev = _cheapest_paths(records, start, end, lambda r: block_cost(r) * load.get(r.peer_id, 1.0), noise, rtt, costs)
    if end not in prev and end != start:
        covered = {b for r in records for b in range(r.start, r.end)}
        raise MissingBlocksError([b for b in range(start, end) if b not in covered], model_id)
    return _route_to(prev, start, end)


def _block_pricer(
    records: list[ServerRecord],
    mode: Mode,
    measured: Mapping[str, float],
    costs: RouteCosts,
    explore: bool = False,
) -> Callable[[ServerRecord], float]:
    """What one block of a server costs a call (before its noise factor): measured where it was, else claimed;
    ``explore`` (calls spread over replicas: stochastic wiring, or new sessions priced by load): a replica never
    measured is priced as the fastest measured one until its own calls measure it."""
    # A claim is believed only as far as the fastest peer measured so far: a stranger that announces an absurd speed
    # under a fresh id would otherwise take every first call.
    fastest = min((measured[r.peer_id] for r in records if r.peer_id in measured), default=0.0)
    # a forward's compute grows with its tokens, as its bytes do; an inference step (one token of each sequence)
    # costs a server about one step whatever the batch (reading the weights dominates)
    scale = costs.tokens if mode == "forward" else 1

    def block_cost(r: ServerRecord) -> float:
        if r.peer_id in measured:
            return measured[r.peer_id] * scale
        if explore and fastest > 0.0:
            # a claim far slower than the machine (a measurement counts the network, a claim does not) would
            # otherwise starve a replica of micro-batches or sessions, and it would never be measured: 32 sessions
            # of one client once piled 28 on the one replica it had measured, 4 on the other three
            return fastest * scale
        speed = r.inference_sps if mode == "inference" else r.forward_tps
        return max(1.0 / max(speed * (r.end - r.start), 1e-9), fastest) * scale

    return block_cost


def _cheapest_paths(
    records: list[ServerRecord],
    start: int,
    end: int,
    block_cost: Callable[[ServerRecord], float],
    noise: Mapping[str, float],
    rtt: Mapping[str, float],
    costs: RouteCosts,
) -> dict[int, tuple[int, ServerRecord]]:
    """Dijkstra over the block boundaries from ``start``: for each boundary reached, the boundary before it on its
    cheapest path and the server that covers the blocks between (``end`` absent: not covered)."""
    points = sorted({start, end} | {p for r in records for p in (r.start, r.end) if start < p < end})
    index = {p: i for i, p in enumerate(points)}
    dist = {start: 0.0}
    prev: dict[int, tuple[int, ServerRecord]] = {}
    heap: list[tuple[float, int, str]] = [(0.0, start, "")]
    while heap:
        d, a, _ = heapq.heappop(heap)
        if a == end:
            break
        if d > dist.get(a, float("inf")):
            continue
        for r in records:
            if not (r.start <= a < r.end):
                continue
            factor = noise.get(r.peer_id, 1.0)
            hop_cost = costs.hop(rtt.get(r.peer_id), r.network_mbps) * factor
            per_block = block_cost(r) * factor
            for b in points[index[a] + 1 :]:
                if b > r.end:
                    break
                nd = d + hop_cost + (b - a) * per_block
                if nd < dist.get(b, float("inf")) - 1e-15:
                    dist[b] = nd
                    prev[b] = (a, r)
                    heapq.heappush(heap, (nd, b, r.peer_id))
    return prev


def _route_to(prev: dict[int, tuple[int, ServerRecord]], start: int, end: int) -> list[Hop]:
    """The hops of the cheapest path to ``end``, read back from ``prev`` (in order from ``start``)."""
    route: list[Hop] = []
    b = end
    while b != start:
        a, r = prev[b]
        share = (b - a) / (r.end - r.start)
        route.append(
            Hop.of(
                r,
                a,
                b,
                step_seconds=share / max(r.inference_sps, 1e-9),
                token_seconds=share / max(r.forward_tps, 1e-9),
            )
        )
        b = a
    return route[::-1]
