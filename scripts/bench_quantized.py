"""Quantized blocks (``swarm.serve --quantize``), per format, in one run, against the unquantized weights measured in
the same run:

- bytes one block takes as a server holds it (codes, scales and unquantized parts counted), and its ratio to 16 bits;
- decode time per block (one new token after a 128-token prefill, KV cache on) and prefill time per block (512
  tokens), on SmolLM2-135M's blocks and on a random-initialised block of a 1B-sized Llama (2048 wide), one thread;
- SmolLM2's perplexity on text it was not trained on, Python's own documentation as the interpreter ships it
  (``pydoc_data.topics``, the first 8,192 tokens), and top-1 agreement with the unquantized model's next tokens;
- QLoRA against LoRA through real servers: SmolLM2 over 3 servers (``0:10 10:20 20:30``), once exact and once in
  NF4, the same LoRA (rank 8, q/v projections, seed 0) trained for 50 steps on the same batches of that text (4 x 64
  tokens, Adam 1e-3); the loss curves and the last 10 steps' mean.

    python scripts/bench_quantized.py [--json out.json] [--steps 50] [--skip-qlora]

Every block runs through ``peers.blocks.quantize`` (the code servers run). Every process uses one torch thread."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
FORMATS = ("none", "int8", "nf4")
TOKENS = 8192
ONE_B = dict(hidden_size=2048, intermediate_size=5504, num_attention_heads=16, num_key_value_heads=16)


def doc_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def quantized_model(folder: Path, fmt: str) -> Any:
    from transformers import AutoModelForCausalLM

    from peers.blocks.quantize import quantize_layer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for layer in model.model.layers:
        quantize_layer(layer, fmt, torch.float32, torch.device("cpu"))
    return model


def quality(folder: Path, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Perplexity and top-1 agreement with the exact model, per format, over ``ids`` in chunks of 1024."""
    out: dict[str, dict[str, float]] = {}
    exact_top: list[torch.Tensor] = []
    for fmt in FORMATS:
        model = quantized_model(folder, fmt)
        nll, n, agree, tops = 0.0, 0, 0, []
        with torch.no_grad():
            for s in range(0, ids.shape[1], 1024):
                x = ids[:, s : s + 1024]
                logits = model(x).logits.float()[0, :-1]
                nll -= torch.log_softmax(logits, -1).gather(1, x[0, 1:, None]).sum().item()
                n += x.shape[1] - 1
                tops.append(logits.argmax(-1))
        if fmt == "none":
            exact_top = tops
        agree = sum(int((a == b).sum()) for a, b in zip(tops, exact_top, strict=True))
        out[fmt] = {"perplexity": math.exp(nll / n), "top1_agreement": agree / n}
        print(f"  {fmt:5s} perplexity {out[fmt]['perplexity']:.3f}  top-1 agreement {agree / n:.4f}", flush=True)
    return out


def _time(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def block_speed(layers: torch.nn.ModuleList, family: Any, config: Any) -> dict[str, float]:
    """Seconds per block: one decode step after a 128-token prefill, and a 512-token prefill."""
    from peers.blocks.backend import SpanBackend
    from swarm.ids import Span

    n = len(layers)
    backend = SpanBackend(config, family, layers, Span(0, n), "cpu", torch.float32)
    hidden = int(config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 128, hidden, generator=gen)
    step = torch.randn(1, 1, hidden, generator=gen)
    long = torch.randn(1, 512, hidden, generator=gen)

    def decode() -> None:
        cache = backend.new_cache()
        backend.run(prompt, Span(0, n), cache=cache, past=0)
        t = time.perf_counter()
        for i in range(16):
            backend.run(step, Span(0, n), cache=cache, past=128 + i)
        decode.seconds = (time.perf_counter() - t) / 16  # type: ignore[attr-defined]

    with torch.no_grad():
        decode()
        per_step = []
        for _ in range(3):
            decode()
            per_step.append(decode.seconds)  # type: ignore[attr-defined]
        prefill = _time(lambda: backend.run(long, Span(0, n)), 2)
    return {"decode_s_per_block": statistics.median(per_step) / n, "prefill_s_per_block": prefill / n}


def blocks_of(folder: Path, fmt: str, count: int) -> tuple[torch.nn.ModuleList, Any, Any]:
    from peers.blocks.families import family_for
    from peers.blocks.quantize import load_quantized
    from swarm.families.weights import load_layers
    from swarm.model_files import load_config

    family = family_for(load_config(folder))
    layers = load_quantized(
        lambda ids: load_layers(family, folder, ids, torch.float32, "cpu"), range(count), fmt, torch.float32, "cpu"
    )
    return torch.nn.ModuleList(layers), family, family.config


def one_b_folder(tmp: Path) -> Path:
    """A random-initialised Llama of the 1B size's widths, 2 blocks (per-block costs are what is compared)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp / "llama-1b-shape"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(**ONE_B, num_hidden_layers=2, vocab_size=1000)
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def blocks(folder: Path, label: str, count: int) -> dict[str, dict[str, float]]:
    from peers.blocks.quantize import held_bytes

    out: dict[str, dict[str, float]] = {}
    for fmt in FORMATS:
        layers, family, config = blocks_of(folder, fmt, count)
        row = {"bytes_per_block": held_bytes(layers) / count, **block_speed(layers, family, config)}
        out[fmt] = row
    sixteen = out["none"]["bytes_per_block"] / 2  # the float32 weights, counted as 16 bits
    for fmt, row in out.items():
        row["bytes_vs_16bit"] = row["bytes_per_block"] / sixteen
        row["decode_speedup"] = out["none"]["decode_s_per_block"] / row["decode_s_per_block"]
        row["prefill_speedup"] = out["none"]["prefill_s_per_block"] / row["prefill_s_per_block"]
        print(
            f"  {label} {fmt:5s} {row['bytes_per_block'] / 2**20:7.2f} MiB/block ({row['bytes_vs_16bit']:.2f}x 16-bit)"
            f"  decode {row['decode_s_per_block'] * 1e3:6.3f} ms/block ({row['decode_speedup']:.2f}x)"
            f"  prefill-512 {row['prefill_s_per_block'] * 1e3:7.2f} ms/block ({row['prefill_speedup']:.2f}x)",
            flush=True,
        )
    return out


def lora_curve(ids: torch.Tensor, fmt: str, steps: int) -> list[float]:
    """LoRA losses through SmolLM2 served by 3 servers in ``fmt``, the same batches and initial adapter each run."""
    from swarm import DistributedModelForCausalLM
    from swarm.launch import LocalSwarm

    spans: list[str | None] = ["0:10", "10:20", "20:30"]
    extra = ("--throughput", "100", "--quantize", fmt)
    with LocalSwarm(MODEL, spans, extra_args=extra) as swarm:
        torch.manual_seed(0)
        with DistributedModelForCausalLM.from_pretrained(
            MODEL,
            initial_peers=swarm.initial_peers,
            tuning="lora",
            lora_rank=8,
            lora_alpha=16,
            allow_quantized=fmt != "none",
            codec="none",
        ) as model:
            assert {h.quantization for h in model.route} <= {fmt}
            opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            windows = ids[0, : (ids.shape[1] // 64) * 64].view(-1, 64)
            losses = []
            for step in range(steps):
                batch = windows[(step * 4) % len(windows) : (step * 4) % len(windows) + 4]
                opt.zero_grad()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert {h.quantization for h in model.route} == {fmt}, model.route
    print(f"  {fmt:5s} LoRA loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip-qlora", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import load_tokenizer, model_folder

    folder = model_folder(load_model_card(MODEL), default_cache_dir())
    ids = load_tokenizer(folder)(doc_text(), return_tensors="pt").input_ids[:, :TOKENS]
    result: dict[str, Any] = {"tokens": int(ids.shape[1])}
    print("quality (SmolLM2-135M, pydoc topics):", flush=True)
    result["quality"] = quality(folder, ids)
    print("blocks:", flush=True)
    result["smollm2_blocks"] = blocks(folder, "SmolLM2", 6)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result["llama_1b_shape_blocks"] = blocks(one_b_folder(Path(tmp)), "1B-shape", 2)
    if not args.skip_qlora:
        print(f"LoRA through 3 servers, {args.steps} steps:", flush=True)
        curves = {fmt: lora_curve(ids, fmt, args.steps) for fmt in ("none", "nf4")}
        tail = {fmt: statistics.mean(c[-10:]) for fmt, c in curves.items()}
        result["lora"] = {"curves": curves, "last10_mean": tail, "qlora_vs_lora": tail["nf4"] / tail["none"]}
        print(f"  QLoRA / LoRA loss (last 10 steps' mean): {tail['nf4'] / tail['none']:.4f}", flush=True)
    q = result["quality"]
    for fmt in ("int8", "nf4"):
        print(f"{fmt}: perplexity {q[fmt]['perplexity'] / q['none']['perplexity']:.4f}x of 32-bit", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
