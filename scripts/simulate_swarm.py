"""The broker's planner on a simulated swarm: 1,000 seeded peers, an 80-block model of 1.75 GB per block (70B
parameters in 16-bit).

    python scripts/simulate_swarm.py [--peers 1000] [--seed 0]

Population: 60% 10 GB cards of throughput 1.0, 25% 24 GB of 2.5, 10% 80 GB of 5.0, 5% 80 GB of 8.0 (blocks per unit
time). Prints planning time (target < 1 s), the bottleneck reached vs the upper bound (total throughput / blocks;
target >= 90%), and how many peers move after 10% of them leave.
"""

from __future__ import annotations

import argparse
import random
import time

from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm

GB = 1024**3
KINDS = [(0.60, 10, 1.0), (0.25, 24, 2.5), (0.10, 80, 5.0), (0.05, 80, 8.0)]


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


if __name__ == "__main__":
    main()
