"""Failover during generation: SmolLM2-135M with two replicas of each of three spans on loopback.

    python scripts/bench_failover.py [--tokens 128] [--seed 0] [--step-timeout 5]

An undisturbed 128-token greedy generation first; then the same generation while one server per span is SIGKILLed
at random moments (the one on the route at that moment); then one with a server frozen by SIGSTOP. Prints tokens
lost (must be 0), whether the output matched the undisturbed run, and the stall per failure (time from the kill to
the next token) as median and max, next to the ordinary time per token.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import time
from dataclasses import replace

import torch

from harness.local_swarm import Disturber
from swarm import DistributedModelForCausalLM
from swarm.config import Timing
from swarm.launch import LocalSwarm

SPANS = ["0:10", "0:10", "10:20", "10:20", "20:30", "20:30"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-timeout", type=float, default=5.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    timing = replace(Timing(), step_timeout=args.step_timeout)
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1588, 30, 2]])  # a fixed prompt; any ids work
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    with LocalSwarm("smollm2-135m", SPANS, extra_args=("--throughput", "100")) as swarm:
        with DistributedModelForCausalLM.from_pretrained(
            "smollm2-135m", initial_peers=swarm.initial_peers, timing=timing
        ) as model:
            clean = Disturber(model, swarm, {}, signal.SIGKILL)
            reference = model.generate(ids, streamer=clean, **gen)
            per_token = statistics.median(b - a for a, b in zip(clean.times[1:], clean.times[2:], strict=False))

            moments = sorted(rng.sample(range(8, args.tokens - 8), 3))
            killer = Disturber(model, swarm, {m: hop for hop, m in enumerate(moments)}, signal.SIGKILL)
            before = model.failovers
            out = model.generate(ids, streamer=killer, **gen)
            kill_failovers = model.failovers - before

            for peer in killer.victims:  # bring each span back to two replicas before the freeze
                swarm.add_peer(peer.span)
            time.sleep(timing.view_refresh + 1)
            freezer = Disturber(model, swarm, {rng.randrange(8, args.tokens - 8): rng.randrange(3)}, signal.SIGSTOP)
            out_frozen = model.generate(ids, streamer=freezer, **gen)
            for peer in freezer.victims:
                peer.proc.send_signal(signal.SIGCONT)

    new = reference.shape[1] - ids.shape[1]
    for name, result, sab in (("SIGKILL x3", out, killer), ("SIGSTOP x1", out_frozen, freezer)):
        got = result.shape[1] - ids.shape[1]
        stalls = sab.stalls()
        print(f"\n{name} during a {new}-token generation (after tokens {sorted(sab.plan)}):")
        print(f"  tokens lost: {new - got}; output identical to the undisturbed run: {torch.equal(result, reference)}")
        print(
            f"  stall per failure: median {statistics.median(stalls):.3f} s, max {max(stalls):.3f} s "
            f"(an ordinary token takes {per_token * 1000:.0f} ms)"
        )
    print(f"  failovers counted during the kills: {kill_failovers}")
    print(f"targets: killed < 1.5 s; frozen < step timeout ({args.step_timeout:.1f} s) + 1 s")


if __name__ == "__main__":
    main()
