"""The broker's planner on a simulated swarm: 1,000 seeded peers, an 80-block model of 1.75 GB per block (70B
parameters in 16-bit).

    python scripts/simulate_swarm.py [--peers 1000] [--seed 0] [--swarms 10]

Population: 60% 10 GB cards of throughput 1.0, 25% 24 GB of 2.5, 10% 80 GB of 5.0, 5% 80 GB of 8.0 (blocks per unit
time). Prints planning time (target < 1 s), the bottleneck reached vs the upper bound (total throughput / blocks;
target >= 90%), and how many peers move after 10% of them leave.

Then ``--swarms`` seeded swarms of catalogue devices (``configs/hardware``), 100 to 1,000 peers in three device mixes,
each peer's per-block throughput PREDICTED by the performance model (``swarm.perf``) for a Llama-2-70B block in
bfloat16: decode tokens/s of a batch of 16 sequences after 1,024 cached positions; memory: the device's less 1 GB;
link: log-uniform 20 to 1,000 Mbit/s, a token's hidden state (16 KiB) crossing it twice. For each swarm: the
predicted throughput (tokens/s, the weakest block's, as every token crosses every block) of the broker's planner
(replication 1, no standbys) and of Petals' rules: peers join in a random order, each at the window of the weakest
blocks (greedy), then rebalance as Petals' servers do (each periodically imagines the swarm re-placed and moves if
that would raise the bottleneck by more than a third: ``swarm.perf.placement.petals_rebalance``); and the same after
a tenth of the peers leave (the planner replans, Petals' servers rebalance). PASS: the planner is at least as good
as Petals' rules on every swarm as placed, and reaches 90% of the upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time

from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm
from swarm.perf.arch import Arch
from swarm.perf.catalogue import load_catalogue
from swarm.perf.model import Link
from swarm.perf.placement import (
    block_throughput,
    bottleneck,
    device_of,
    greedy_spans,
    link_tokens,
    petals_rebalance,
)

GB = 1024**3
KINDS = [(0.60, 10, 1.0), (0.25, 24, 2.5), (0.10, 80, 5.0), (0.05, 80, 8.0)]
LLAMA2_70B = Arch(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000, head_dim=128)
MIXES = {  # fractions of catalogue devices (the 24 GB share split between RTX 3090 and 4090)
    "consumer": {"rtx3080": 0.80, "rtx3090": 0.075, "rtx4090": 0.075, "a100": 0.04, "h100": 0.01},
    "default": {"rtx3080": 0.60, "rtx3090": 0.125, "rtx4090": 0.125, "a100": 0.10, "h100": 0.05},
    "datacentre": {"rtx3080": 0.40, "rtx3090": 0.15, "rtx4090": 0.15, "a100": 0.20, "h100": 0.10},
}


def population(n: int, rng: random.Random) -> list[PeerInfo]:
    peers = []
    for i in range(n):
        x = rng.random()
        cumulative = [sum(k[0] for k in KINDS[: j + 1]) for j in range(len(KINDS))]
        _, gb, speed = next((k for k, c in zip(KINDS, cumulative, strict=True) if x < c), KINDS[-1])
        peers.append(PeerInfo(f"peer{i:04d}", speed, int((gb - 1) * GB)))  # ~1 GB kept for activations and cache
    return peers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--block-gb", type=float, default=1.75)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--swarms", type=int, default=10, help="seeded catalogue swarms compared with greedy (0: none)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    block_bytes = int(args.block_gb * GB)
    peers = population(args.peers, rng)
    policy = Policy(replication=2, standby_fraction=0.05)

    t0 = time.perf_counter()
    plan = plan_swarm(peers, args.blocks, block_bytes, policy)
    took = time.perf_counter() - t0
    standby = sum(1 for pl in plan.placements.values() if pl.role == Role.STANDBY)
    print(f"{args.peers} peers, {args.blocks} blocks of {args.block_gb} GB")
    print(f"planning time: {took:.3f} s (target < 1 s)")
    print(
        f"bottleneck {plan.bottleneck:.2f} vs upper bound {plan.upper_bound:.2f}: "
        f"{plan.bottleneck / plan.upper_bound:.1%} (target >= 90%; {standby} standbys held back)"
    )
    serving_bound = sum(pr.throughput for pr in peers if plan.placements[pr.peer_id].role == Role.SERVE) / args.blocks
    print(f"  of the serving peers' own bound {serving_bound:.2f}: {plan.bottleneck / serving_bound:.1%}")

    current = [
        PeerInfo(
            pr.peer_id,
            pr.throughput,
            pr.memory,
            span=plan.placements[pr.peer_id].span,
            role=plan.placements[pr.peer_id].role,
        )
        for pr in peers
    ]
    leaving = set(rng.sample([pr.peer_id for pr in current], len(current) // 10))
    remaining = [pr for pr in current if pr.peer_id not in leaving]
    t0 = time.perf_counter()
    after = plan_swarm(remaining, args.blocks, block_bytes, policy)
    took = time.perf_counter() - t0
    moved = after.moves_from(remaining)
    promoted = sum(1 for pr in remaining if pr.role == Role.STANDBY and after.placements[pr.peer_id].role == Role.SERVE)
    print(
        f"after {len(leaving)} peers leave: replanned in {took:.3f} s, {moved} peers load a new span, "
        f"{promoted} standbys promoted; bottleneck {after.bottleneck:.2f} of bound {after.upper_bound:.2f} "
        f"({after.bottleneck / after.upper_bound:.1%})"
    )
    if args.swarms:
        compare(args.swarms)


def catalogue_swarm(n: int, mix: dict[str, float], rng: random.Random) -> list[PeerInfo]:
    """``n`` peers drawn from ``mix``, rates predicted by the performance model."""
    cat = load_catalogue()
    devices = {k: device_of(cat[k]) for k in mix}
    rate = {k: block_throughput(d, LLAMA2_70B, batch=16, past=1024) for k, d in devices.items()}
    token_bytes = LLAMA2_70B.hidden * 2
    kinds, weights = list(mix), list(mix.values())
    peers = []
    for i in range(n):
        k = rng.choices(kinds, weights)[0]
        mbps = math.exp(rng.uniform(math.log(20), math.log(1000)))
        tokens = link_tokens(Link(bandwidth=mbps * 1e6 / 8), token_bytes)
        peers.append(PeerInfo(f"{k}-{i:04d}", rate[k], int(devices[k].memory), link_tokens=tokens))
    return peers


def compare(swarms: int) -> None:
    """Each catalogue swarm placed by the planner and by Petals' rules, then again after a tenth of its peers leave
    (the same peers for both): the planner replans; Petals' servers stay where they joined unless their periodic
    check says the swarm would gain more than a third by moving (``petals_rebalance``)."""
    block_bytes = int(LLAMA2_70B.block_bytes(2))
    blocks = LLAMA2_70B.layers
    print(f"\nLlama-2-70B ({blocks} blocks of {block_bytes / 1e9:.2f} GB), catalogue devices, predicted tokens/s:")
    cat = load_catalogue()
    each = {k: block_throughput(device_of(cat[k]), LLAMA2_70B, batch=16, past=1024) for k in MIXES["default"]}
    print("predicted decode tokens/s per block (batch 16): " + ", ".join(f"{k} {v:.0f}" for k, v in each.items()))
    print(
        "greedy: Petals' joining rule alone (nobody moves); petals: the same, then its servers' periodic rebalancing "
        "(balance quality 0.75); after the leavers go, stay: Petals' servers where they were, petals: rebalanced"
    )
    print(
        f"{'seed':>4} {'mix':>10} {'peers':>5} | {'planner':>8} {'greedy':>8} {'petals':>8} {'moves':>5} "
        f"{'plan/pet':>8} {'bound':>6} | after 10% leave: {'planner':>8} {'moves':>5} {'stay':>8} {'petals':>8} "
        f"{'moves':>5} {'plan/pet':>8} {'bound':>6}"
    )
    ok = True
    ratios: list[float] = []
    for seed in range(swarms):
        rng = random.Random(seed)
        n = 100 + 100 * (seed % 10)
        mix = list(MIXES)[seed % len(MIXES)]
        peers = catalogue_swarm(n, MIXES[mix], rng)
        policy = Policy(replication=1, standby_fraction=0.0)
        plan = plan_swarm(peers, blocks, block_bytes, policy)
        rates = [(p.throughput, p.link_tokens) for p in peers]
        caps = [min(blocks, p.memory // block_bytes) for p in peers]
        joined = greedy_spans(rates, caps, blocks, seed)
        greedy = bottleneck(joined, rates, blocks)
        petals_spans, petals_moves = petals_rebalance(joined, rates, blocks, seed)
        petals = bottleneck(petals_spans, rates, blocks)
        share = plan.bottleneck / plan.upper_bound
        ok = ok and plan.bottleneck >= petals * (1 - 1e-9) and share >= 0.9
        # a tenth of the peers leave; the rest hold what they held
        gone = set(random.Random(seed + 1000).sample(range(n), n // 10))
        keep = [i for i in range(n) if i not in gone]
        remaining = [
            dataclasses.replace(peers[i], span=plan.placements[peers[i].peer_id].span, role=Role.SERVE) for i in keep
        ]
        after = plan_swarm(remaining, blocks, block_bytes, policy)
        left_rates = [rates[i] for i in keep]
        static = bottleneck([petals_spans[i] for i in keep], left_rates, blocks)
        rebalanced, after_moves = petals_rebalance([petals_spans[i] for i in keep], left_rates, blocks, seed)
        petals_after = bottleneck(rebalanced, left_rates, blocks)
        ratios += [plan.bottleneck / max(petals, 1e-12), after.bottleneck / max(petals_after, 1e-12)]
        print(
            f"{seed:>4} {mix:>10} {n:>5} | {plan.bottleneck:>8.0f} {greedy:>8.0f} {petals:>8.0f} {petals_moves:>5} "
            f"{plan.bottleneck / max(petals, 1e-12):>8.2f} {share:>6.1%} | {'':>16} {after.bottleneck:>8.0f} "
            f"{after.moves_from(remaining):>5} {static:>8.0f} {petals_after:>8.0f} {after_moves:>5} "
            f"{after.bottleneck / max(petals_after, 1e-12):>8.2f} {after.bottleneck / after.upper_bound:>6.1%}"
        )
    print(f"planner / Petals-style: {min(ratios):.2f} to {max(ratios):.2f}")
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: planner >= Petals-style (rebalancing) on every swarm and >= 90% of the upper bound")


if __name__ == "__main__":
    main()
