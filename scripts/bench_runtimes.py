"""The two runtimes on the same span of the same weights, in one process and one run: decode (single-token steps on
a KV cache) and prefill (one forward of a long prompt), in tokens/s, with the ONNX/torch ratio.

    python scripts/bench_runtimes.py                          # SmolLM2-135M (30 blocks) and tiny Llama (8 blocks)
    python scripts/bench_runtimes.py --models tiny-llama --repeats 7 --threads 2

Each runtime is built as a server builds it (``ServingStage``: the ONNX export is written once into the cache
directory and reused). Runs alternate (torch, onnx, torch, ...; median of ``--repeats`` after a warm-up of each), so
slow drifts of a shared machine weigh on both sides alike. Both use ``--threads`` compute threads (default 1, as a
server's default). Ratios above 1 mean ONNX Runtime is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from peers.blocks.serving_stage import ServingStage
from peers.config import PeerConfig
from peers.serving.config import ComputeConfig
from peers.serving.runtime import SpanRuntime
from swarm.ids import Span, parse_span


def build(model: str, runtime: str, threads: int, span: Span | None) -> SpanRuntime:
    cfg = PeerConfig(model=model, compute=ComputeConfig(runtime=runtime, threads=threads))
    stage = ServingStage.from_config(cfg.model, cfg.compute, cfg.cache_dir)
    return stage._load(span or Span(0, stage.model.num_blocks))


def decode(rt: SpanRuntime, steps: int, prompt: int = 16) -> Callable[[], float]:
    """Seconds for ``steps`` single-token steps after a ``prompt``-token prefill (not timed)."""
    hidden = int(rt.config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt, hidden, generator=gen)
    tokens = torch.randn(steps, 1, 1, hidden, generator=gen)

    def run() -> float:
        cache = rt.new_cache()
        rt.run(x, rt.span, cache=cache)
        t0 = time.perf_counter()
        for i in range(steps):
            rt.run(tokens[i], rt.span, cache=cache, past=prompt + i)
        return time.perf_counter() - t0

    return run


def prefill(rt: SpanRuntime, seq: int) -> Callable[[], float]:
    """Seconds for one forward of ``seq`` tokens into a fresh KV cache (an inference session's first step)."""
    x = torch.randn(1, seq, int(rt.config.hidden_size), generator=torch.Generator().manual_seed(1))

    def run() -> float:
        cache = rt.new_cache()
        t0 = time.perf_counter()
        rt.run(x, rt.span, cache=cache)
        return time.perf_counter() - t0

    return run


def paired(a: Callable[[], float], b: Callable[[], float], repeats: int) -> tuple[float, float]:
    a(), b()  # warm-up: first-call allocations, ONNX Runtime's lazy initialisation
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(a())
        times[1].append(b())
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny-llama"])
    p.add_argument("--span", type=parse_span, default=None, help="blocks A:B (default: all of each model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=32, help="decode steps per run")
    p.add_argument("--seq", type=int, default=128, help="prefill tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[tuple[str, str, float, float]] = []
    with torch.inference_mode():
        for model in args.models:
            rt_torch = build(model, "torch", args.threads, args.span)
            rt_onnx = build(model, "onnx", args.threads, args.span)
            label = f"{model} blocks {rt_torch.span}"
            t, o = paired(decode(rt_torch, args.steps), decode(rt_onnx, args.steps), args.repeats)
            rows.append((label, f"decode tokens/s ({args.steps} steps after 16)", args.steps / t, args.steps / o))
            t, o = paired(prefill(rt_torch, args.seq), prefill(rt_onnx, args.seq), args.repeats)
            rows.append((label, f"prefill tokens/s ([1, {args.seq}])", args.seq / t, args.seq / o))
            del rt_torch, rt_onnx
    print(f"\n{args.threads} thread(s), median of {args.repeats}\n")
    print("| span | measure | torch | onnx | onnx / torch |")
    print("| --- | --- | --- | --- | --- |")
    for label, what, t, o in rows:
        print(f"| {label} | {what} | {t:.1f} | {o:.1f} | {o / t:.2f}x |")


if __name__ == "__main__":
    main()
