"""The performance model's scoring of placements and routes, shared by the broker's planner and the client's routing.

Two questions, two rules:

* **Throughput** (the broker: how much does a peer add to each block of its span?). A serving peer is pipelined:
  while it computes one batch its link carries the activations of others, so its compute and its network overlap and
  its rate is the slower of the two: ``min(block_throughput / blocks, link_tokens)`` tokens per second through
  each block of a span of ``blocks`` blocks (:func:`peer_rate`).
* **Latency** (the client: how long does one sequence's step take through a hop?). A single sequence waits for
  every stage in turn, so nothing overlaps: the link's delay, its bytes over the bandwidth, the swarm software's fixed
  cost per hop and the compute add up (:func:`hop_seconds`, :func:`span_seconds_per_token`).

Pure: no torch, no globals; every number comes in as an argument or in a :class:`RouteCosts`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarm.perf.arch import Arch, context_of
from swarm.perf.catalogue import DeviceSpec
from swarm.perf.model import Device, Link

KERNELS_PER_BLOCK = 20  # eager kernel launches in one decoder block's forward (norms, projections, rotary, MLP)


def link_tokens(link: Link, token_bytes: float) -> float:
    """Tokens per second a peer's link carries: every token crosses it twice (into and out of the span)."""
    if token_bytes <= 0 or not math.isfinite(link.bandwidth):
        return math.inf
    return link.bandwidth / (2 * token_bytes)


def peer_rate(block_throughput: float, blocks: int, link_tokens: float = math.inf) -> float:
    """THROUGHPUT: tokens per second a peer adds to each block of a span of ``blocks`` blocks. Its compute
    (``block_throughput`` block-tokens per second, i.e. tokens/s when serving one block) is shared by the span's
    blocks; its link transfers overlap other tokens' compute, so the peer runs at the slower of the two rates."""
    return min(block_throughput / max(blocks, 1), link_tokens)


def span_seconds_per_token(block_seconds: float, blocks: int, link: Link, token_bytes: float, software: float) -> float:
    """LATENCY of one token through a peer's span, nothing overlapping: compute (``blocks`` x ``block_seconds``),
    the token's bytes into and out of the peer over its link's bandwidth, and ``software`` (the per-call fixed cost
    already amortised over the call's tokens by the caller). The link's one-way delay is per call, not per token:
    :func:`hop_seconds` adds it. For THROUGHPUT these terms overlap instead: see :func:`peer_rate`."""
    serial = 2 * token_bytes / link.bandwidth if math.isfinite(link.bandwidth) else 0.0
    return blocks * block_seconds + serial + software


def hop_seconds(link: Link, nbytes: float, software: float, compute: float = 0.0, chained: bool = False) -> float:
    """LATENCY of one hop of one step carrying ``nbytes`` of activations: client-mediated, the client sends to the
    server and reads its reply (two transfers: the full round trip and the bytes both ways); chained, the server
    passes its output on (one transfer: one-way delay and the bytes once). Plus the swarm software's fixed cost per
    hop and the hop's ``compute``; nothing overlaps. Connections are kept open: no slow start."""
    transfer = Link(link.delay, link.bandwidth, warm=True).time(nbytes).comm
    return (1 if chained else 2) * transfer + software + compute


# (a tensor's bytes, the link's announced Mbit/s or None) -> the bytes that go on the wire: the codec the transport
# would choose for that tensor on that link (the client passes ``swarm.codecs.choose_codec``'s rule)
Wire = Callable[[float, float | None], float]


@dataclass(frozen=True)
class RouteCosts:
    """What routing assumes of a hop it has not measured. Defaults reproduce a flat 3 ms per hop client-mediated
    (``ClientConfig.hop_latency_s``): 2 x 1.5 ms one-way, no software cost on top, no bytes priced. The live client
    passes its real ones (``SwarmView.costs``)."""

    delay: float = 0.0015  # s: one-way delay prior for a peer whose round trip was never measured
    software: float = 0.0  # s: the swarm's own fixed cost per hop (protocol stack, framing, checks)
    token_bytes: float = 0.0  # bytes of one token's hidden state as the client holds it (0: not priced)
    tokens: int = 1  # tokens per step the route is chosen for (a prompt: many; a decode step: one)
    chained: bool = False  # steps pass server to server (one transfer per hop) rather than through the client
    wire: Wire | None = None  # the codec's bytes on the wire (None: the tensor as it is)

    @classmethod
    def from_prior(
        cls,
        hop_latency: float,
        *,
        software: float = 0.0,
        token_bytes: float = 0.0,
        tokens: int = 1,
        chained: bool = False,
        wire: Wire | None = None,
    ) -> RouteCosts:
        """Costs whose unmeasured, client-mediated, byte-free hop totals ``hop_latency`` (or the software cost, if
        that is more): the software cost, and the rest as a round trip."""
        delay = max(hop_latency - software, 0.0) / 2
        return cls(delay, software, token_bytes, tokens, chained, wire)

    def link(self, rtt: float | None, network_mbps: float | None) -> Link:
        """A peer's link as routing prices it: half its measured round trip (the prior otherwise) and its announced
        bandwidth (unknown: not a limit)."""
        delay = self.delay if rtt is None else rtt / 2
        bandwidth = network_mbps * 1e6 / 8 if network_mbps else math.inf
        return Link(delay, bandwidth)

    def hop(self, rtt: float | None, network_mbps: float | None) -> float:
        """Seconds of one hop's network and software, before its compute."""
        nbytes = self.tokens * self.token_bytes
        if self.wire is not None and nbytes > 0:
            nbytes = self.wire(nbytes, network_mbps)
        return hop_seconds(self.link(rtt, network_mbps), nbytes, self.software, chained=self.chained)


# ---- predicted peers ---------------------------------------------------------------------------------------------


def device_of(spec: DeviceSpec, dtype: str = "bfloat16", reserve: float = 1e9) -> Device:
    """The model's device for a catalogue entry: peak rates times their measured-in-practice efficiencies, the
    launch overhead of a block's kernels, and its memory less ``reserve`` bytes (activations, cache, context)."""
    return Device(
        name=spec.name,
        flops=spec.flops(dtype) * spec.matmul_efficiency,
        bandwidth=spec.memory_bandwidth * spec.memory_efficiency,
        dtype_bytes=2.0 if dtype.removeprefix("torch.") in ("float16", "bfloat16") else 4.0,
        block_overhead=KERNELS_PER_BLOCK * spec.launch_overhead,
        memory=max(spec.memory_bytes - reserve, 0.0),
    )


def block_throughput(device: Device, arch: Arch, batch: int = 16, past: int = 1024) -> float:
    """Predicted decode tokens per second through one block: ``batch`` sequences stepping one token each after
    ``past`` cached positions (memory-bound on the weights for any realistic batch)."""
    return batch / device.block(arch, batch, context_of(past, 1)).total


# ---- the Petals-style baseline -----------------------------------------------------------------------------------

BALANCE_QUALITY = 0.75  # Petals servers' default: move only if the swarm could reach over 1 / 0.75 its bottleneck
STAY = 1e-3  # a server's own share counts this much more where it is: near-ties keep it in place (no churn cycles)


def best_start(totals: Sequence[float], length: int) -> int:
    """Petals' choice of a window of ``length`` blocks: the one whose per-block throughputs, sorted from the
    weakest, are smallest (compared as sorted lists: the weakest block first, then the next...)."""
    starts = range(len(totals) - length + 1)
    lows = [min(totals[s : s + length]) for s in starts]  # the sorted lists' first elements decide unless tied
    low = min(lows)
    ties = [s for s in starts if lows[s] == low]
    return ties[0] if len(ties) == 1 else min(ties, key=lambda s: sorted(totals[s : s + length]))


def greedy_spans(
    rates: Sequence[tuple[float, float]], capacities: Sequence[int], num_blocks: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Petals' placement at joining: peers join one at a time in a random order (``seed``), each takes as many blocks
    as its memory holds at :func:`best_start` of the swarm it finds (cover the weakest block first). ``rates`` are
    (block_throughput, link_tokens) per peer; a peer of capacity 0 gets the empty span (0, 0). Returns each peer's
    span, in the input order. Without :func:`petals_rebalance` nobody moves afterwards."""
    totals = [0.0] * num_blocks
    out = [(0, 0)] * len(rates)
    order = list(range(len(rates)))
    random.Random(seed).shuffle(order)
    for i in order:
        length = min(capacities[i], num_blocks)
        if length < 1:
            continue
        start = best_start(totals, length)
        each = peer_rate(rates[i][0], length, rates[i][1])
        for b in range(start, start + length):
            totals[b] += each
        out[i] = (start, start + length)
    return out


def _add(totals: list[float], span: tuple[int, int], amount: float) -> None:
    for b in range(*span):
        totals[b] += amount


def _settle(spans: list[tuple[int, int]], each: list[float], totals: list[float], rng: random.Random) -> None:
    """Every server in turn (a fresh random order each pass) takes its best window, its own share counted with a
    bias to stay, until a whole pass moves nobody. In place."""
    moved = True
    while moved:
        moved = False
        order = [i for i, (a, b) in enumerate(spans) if b > a]
        rng.shuffle(order)
        for i in order:
            span, length = spans[i], spans[i][1] - spans[i][0]
            _add(totals, span, -each[i] * (1 + STAY))
            start = best_start(totals, length)
            _add(totals, span, each[i] * STAY)  # its share is out of the totals now
            if start != span[0]:
                spans[i] = (start, start + length)
                moved = True
            _add(totals, spans[i], each[i])


def should_move(
    i: int,
    spans: Sequence[tuple[int, int]],
    each: Sequence[float],
    totals: Sequence[float],
    rng: random.Random,
    quality: float = BALANCE_QUALITY,
    imagined: dict[tuple[tuple[int, int], ...], float] | None = None,
) -> bool:
    """Petals' periodic check by server ``i`` (``should_choose_other_blocks``), in this model's terms: without its
    own share (biased to stay), is its best window elsewhere? If so, and if leaving would not uncover a block, it
    imagines moving there and every server then re-choosing in turn until nobody moves. It moves only if that
    imagined swarm's bottleneck is more than ``1 / quality`` times today's. ``each``: every server's share of each
    block of its span; ``totals``: each block's sum of them (today's swarm). ``imagined`` (swarm -> the imagined
    bottleneck): a cache that makes the imagining once per state of the swarm rather than once per server (the
    imagined swarms differ only in which server moves first)."""
    today = min(totals)
    # no arrangement's weakest block beats the average block: a swarm within ``quality`` of that bound stays put
    # (the imagined re-choosing below could not pass the test, so it is skipped)
    bound = sum(e * (b - a) for (a, b), e in zip(spans, each, strict=True)) / len(totals)
    if today >= (quality - STAY) * bound:
        return False
    work = list(totals)
    span, length = spans[i], spans[i][1] - spans[i][0]
    _add(work, span, -each[i] * (1 + STAY))
    if today > STAY and min(work) <= 0:
        return False  # its blocks would be served by nobody while it moves
    start = best_start(work, length)
    if start == span[0]:
        return False  # already where it helps most
    key = tuple(spans)
    if imagined is not None and key in imagined:
        better = imagined[key]
    else:
        _add(work, span, each[i] * STAY)  # its share is out of the totals now
        moved = list(spans)
        moved[i] = (start, start + length)
        _add(work, moved[i], each[i])
        _settle(moved, list(each), work, rng)
        better = min(work)
        if imagined is not None:
            imagined[key] = better
    return better >= max(today, STAY) and today / better < quality - STAY


def petals_rebalance(
    spans: Sequence[tuple[int, int]],
    rates: Sequence[tuple[float, float]],
    num_blocks: int,
    seed: int = 0,
    quality: float = BALANCE_QUALITY,
    max_rounds: int = 20,
) -> tuple[list[tuple[int, int]], int]:
    """Petals' servers after joining: every balance period each server, in a random order (``seed``), runs
    :func:`should_move`; one that should leaves its span and joins again at :func:`best_start` of the swarm without
    it. Rounds go on until one moves nobody (or ``max_rounds``). Returns the spans and how many moves were made.
    Unlike Petals, the imagined re-choosing runs once per state of the swarm, not once per checking server: at 1,000
    servers Petals' way would take hours here, and the imagined swarms differ only in which server moves first."""
    rng = random.Random(seed)
    out = list(spans)
    each = [peer_rate(t, e - s, link) if e > s else 0.0 for (s, e), (t, link) in zip(out, rates, strict=True)]
    totals = [0.0] * num_blocks
    for span, e in zip(out, each, strict=True):
        _add(totals, span, e)
    moves, imagined = 0, dict[tuple[tuple[int, int], ...], float]()
    for _ in range(max_rounds):
        moved = False
        order = [i for i, (a, b) in enumerate(out) if b > a]
        rng.shuffle(order)
        for i in order:
            if not should_move(i, out, each, totals, rng, quality, imagined):
                continue
            _add(totals, out[i], -each[i])  # it leaves, and joins again where the swarm without it is weakest
            length = out[i][1] - out[i][0]
            start = best_start(totals, length)
            moved = moved or out[i][0] != start
            moves += out[i][0] != start
            out[i] = (start, start + length)
            _add(totals, out[i], each[i])
        if not moved:
            break
    return out, moves


def bottleneck(spans: Sequence[tuple[int, int]], rates: Sequence[tuple[float, float]], num_blocks: int) -> float:
    """The swarm's throughput (tokens/s) for these spans: every token crosses every block, so the weakest block's
    total."""
    totals = [0.0] * num_blocks
    for (start, end), (t, link) in zip(spans, rates, strict=True):
        if end > start:
            each = peer_rate(t, end - start, link)
            for b in range(start, end):
                totals[b] += each
    return min(totals) if totals else 0.0
