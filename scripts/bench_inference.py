"""Inference, forward and forward+backward through a local swarm vs the same weights run locally, in one run.

    python scripts/bench_inference.py                # tiny Llama (2 peers) and SmolLM2-135M (3 peers)
    python scripts/bench_inference.py --models tiny-llama --repeats 5

Every process uses one torch thread, the local reference too. Ratios > 1 for speed (tokens/s) and < 1 for time mean
the swarm is ahead. The local forward+backward freezes the blocks' weights, as they are frozen on servers, and
computes gradients for the client's own parameters (embeddings, norm, head): the same work in both runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swarm import DistributedModelForCausalLM
from swarm.config import default_cache_dir, load_model_card
from swarm.launch import LocalSwarm
from swarm.model_files import load_config, model_folder

SPANS = {
    "tiny-llama": ["0:4", "4:8"],
    "smollm2-135m": ["0:10", "10:20", "20:30"],
    "mid-llama": ["0:2", "2:4", "4:6", "6:8", "8:10"],  # the cost model's held-out workload (validate_model.py)
}
DEFAULT_MODELS = ["tiny-llama", "smollm2-135m"]


def paired(local, swarm, repeats: int) -> tuple[float, float]:
    """Median times of two functions, measured alternately (local, swarm, local, ...) after a warm-up of each, so
    slow drifts of this shared machine (page cache, clocks, neighbours) weigh on both sides alike."""
    local()
    swarm()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((local, times[0]), (swarm, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def bench(model_name: str, args) -> list[tuple[str, float, float]]:
    from transformers import AutoModelForCausalLM

    folder = model_folder(load_model_card(model_name), default_cache_dir())
    vocab = load_config(folder).vocab_size
    local = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    prompt = torch.randint(0, vocab, (1, 16))
    long = torch.randint(0, vocab, (1, args.seq))
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        model(long, labels=long).loss.backward()

    rows = []
    spans = SPANS[model_name]
    with LocalSwarm(model_name, spans, extra_args=("--throughput", "100")) as swarm:
        with DistributedModelForCausalLM.from_pretrained(model_name, initial_peers=swarm.initial_peers) as remote:
            out_r = remote.generate(prompt, **gen)
            out_l = local.generate(prompt, **gen)
            assert torch.equal(out_r, out_l), "swarm and local generations differ"
            t_local, t_swarm = paired(
                lambda: local.generate(prompt, **gen), lambda: remote.generate(prompt, **gen), args.repeats
            )
            rows.append(("decode tokens/s", args.new_tokens / t_local, args.new_tokens / t_swarm))
            with torch.no_grad():
                rows.append(
                    (f"forward [1, {args.seq}] s", *paired(lambda: local(long), lambda: remote(long), args.repeats))
                )
            for p in local.model.layers.parameters():
                p.requires_grad_(False)
            rows.append(
                (
                    f"forward+backward [1, {args.seq}] s",
                    *paired(lambda: train_step(local), lambda: train_step(remote), args.repeats),
                )
            )
            hops = len(spans)
            per_hop = (t_swarm - t_local) / args.new_tokens / hops * 1000
            rows.append(("per-hop overhead per decode step, ms", 0.0, per_hop))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(SPANS))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here (read by validate_model.py)")
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[tuple[str, float, float]]] = {}
    for model_name in args.models:
        rows = results[model_name] = bench(model_name, args)
        print(f"\n{model_name}: {len(SPANS[model_name])} peers on 127.0.0.1, 1 torch thread per process")
        print(f"| {'metric':<38} | {'local':>9} | {'swarm':>9} | {'ratio':>6} |")
        print(f"|{'-' * 40}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
        for name, local, swarm in rows:
            if name.startswith("per-hop"):
                print(f"| {name:<38} | {'':>9} | {swarm:>9.2f} | {'':>6} |")
            else:
                ratio = swarm / local
                print(f"| {name:<38} | {local:>9.3f} | {swarm:>9.3f} | {ratio:>5.2f}x |")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {"args": vars(args) | {"json": str(args.json)}, "spans": SPANS, "results": results}, indent=1
                )
            )


if __name__ == "__main__":
    main()
