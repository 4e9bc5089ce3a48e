"""What plans cost the client: compiling one per route, and walking one per decode step, against the work a decode
step does on the client anyway, measured in the same run.

    python scripts/bench_plans.py                   # SmolLM2-135M's shapes, routes of 1, 3 and 10 hops

The executor's walk is timed with client modules so small that they cost next to nothing (an 8-wide model: the
plan's shapes are SmolLM2's, its modules' work is not), and a remote part that hands the hidden states straight
back, so the difference between the walk and calling the same modules directly is the plan's own cost per step.
The issue's bound: at most 0.1 ms per decode step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from swarm.client.executor import Context, Executor, PlanCache, schedule
from swarm.client.runner import ModelOps
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, finetune_plan, forward_plan, generate_plan
from swarm.plan.ir import Plan


class Parts:
    """SmolLM2-135M's client modules (random weights: the cost does not depend on their values)."""

    def __init__(self, hidden: int, vocab: int) -> None:
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def embed(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(ids)
        return out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out

    def prompt_vectors(self) -> torch.Tensor | None:
        return None

    def causal_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def route(hops: int, blocks: int) -> list[Hop]:
    cuts = [round(i * blocks / hops) for i in range(hops + 1)]
    return [Hop(f"12D3KooPeer{i:02d}", a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` rounds of 50 calls (as timeit advises: slower rounds
    measure the machine's other work, not ``fn``)."""
    fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        rounds.append((time.perf_counter() - t0) / 50)
    return min(rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    shape = ModelShape("smollm2-135m", 30, 576, 49152)
    parts = Parts(8, 8)  # the plan does not look at the modules' sizes: these cost nothing next to the walk
    executor = Executor(ModelOps(parts))
    ids = torch.tensor([[3]])

    print("compiling a plan (once per route), validation included:")
    print(f"{'hops':>4}  {'generate':>10}  {'forward':>10}  {'finetune':>10}  {'nodes (finetune)':>16}")
    for hops in (1, 3, 10):
        r = route(hops, shape.num_blocks)
        builders: list[Callable[[], Plan]] = [
            lambda r=r: generate_plan(shape, r, max_length=2048),  # type: ignore[misc]
            lambda r=r: forward_plan(shape, r),  # type: ignore[misc]
            lambda r=r: finetune_plan(shape, r),  # type: ignore[misc]
        ]
        costs = [timed(b, args.repeats) * 1e3 for b in builders]
        nodes = len(builders[2]().nodes)
        print(f"{hops:>4}  {costs[0]:>8.2f}ms  {costs[1]:>8.2f}ms  {costs[2]:>8.2f}ms  {nodes:>16}")

    print("\none decode step on the client: the executor's walk vs the same modules called directly:")
    print(f"{'hops':>4}  {'direct':>10}  {'executor':>10}  {'overhead':>10}  {'ratio':>6}")
    cache = PlanCache()
    with torch.no_grad():
        for hops in (1, 3, 10):
            r = route(hops, shape.num_blocks)
            key = ("generate", tuple(r), 2048, 0)

            def step(key: tuple[object, ...] = key, r: list[Hop] = r) -> torch.Tensor:
                plan, sched = cache.get(key, lambda: generate_plan(shape, r, max_length=2048))
                out = executor.run(plan, sched, {"input_ids": ids}, Context(), lambda p, h, c: h)
                return out["logits"]

            def direct() -> torch.Tensor:
                return parts.head(parts.embed(ids))

            # paired: alternate the two so drifts of a shared machine weigh on both
            a, b = [], []
            for _ in range(args.repeats * 4):
                a.append(timed(direct, 1))
                b.append(timed(step, 1))
            t_direct, t_plan = min(a), min(b)
            overhead = (t_plan - t_direct) * 1e6
            print(
                f"{hops:>4}  {t_direct * 1e6:>8.1f}us  {t_plan * 1e6:>8.1f}us  {overhead:>8.1f}us  "
                f"{t_plan / t_direct:>5.2f}x"
            )
    sched = schedule(generate_plan(shape, route(3, shape.num_blocks), max_length=2048))
    print(f"\n(a 3-hop decode step walks {len(sched.steps)} steps; bound: 100 us of overhead per step)")


if __name__ == "__main__":
    main()
