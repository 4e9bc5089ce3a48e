"""Pre-training tokens/s through a local swarm vs the same training in one process, in one run.

    python scripts/bench_pretrain.py                       # configs/runs/tiny-llama.toml, 3 stages, 40 steps each
    python scripts/bench_pretrain.py --steps 100 --plot losses.png

Both sides start from the same per-tensor seeds, read the same samples in the same order and use AdamW with the
same schedule, so their loss curves must coincide (printed side by side, and plotted to a PNG). Steps alternate
(local, swarm, local, ...) so slow drifts of this machine weigh on both alike; every process uses one torch thread.
Bytes are counted over every message the trainer sent and received.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import tempfile
import time
import zlib
from pathlib import Path

import torch

from swarm.config import Timing
from swarm.local_swarm import LocalSwarm
from swarm.training.data import Samples, corpus_files, tokenize
from swarm.training.local import LocalTraining
from swarm.training.run import load_run
from swarm.training.trainer import Trainer

SHIPPED = Path(__file__).parents[1] / "configs" / "runs" / "tiny-llama.toml"


def save_plot(path: Path, series: dict[str, list[float]], width: int = 720, height: int = 420) -> None:
    """A line plot as a PNG, with no plotting library: white canvas, axes, one colour per series."""
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44)]
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    left, right, top, bottom = 50, width - 20, 20, height - 40
    values = [v for s in series.values() for v in s]
    lo, hi = min(values), max(values)
    steps = max(len(s) for s in series.values())

    def dot(x: int, y: int, colour) -> None:
        for dx in (0, 1):
            for dy in (0, 1):
                if 0 <= y + dy < height and 0 <= x + dx < width:
                    pixels[y + dy][x + dx] = colour

    for x in range(left, right + 1):
        pixels[bottom][x] = (0, 0, 0)
    for y in range(top, bottom + 1):
        pixels[y][left] = (0, 0, 0)
    for index, (colour, values) in enumerate(zip(colours, series.values(), strict=False)):
        points = [
            (left + (right - left) * i / max(steps - 1, 1), bottom - (bottom - top) * (v - lo) / max(hi - lo, 1e-9))
            for i, v in enumerate(values)
        ]
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
            for k in range(n + 1):
                dot(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), colour)
        for j in range(20):  # a legend swatch per series, top right (order: as given)
            dot(right - 30 + j, top + 12 * index, colour)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=SHIPPED)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3, help="steps of each side not timed")
    p.add_argument("--plot", type=Path, default=Path("pretrain-losses.png"))
    args = p.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        text = args.run.read_text().replace('dir = ""', f'dir = "{tmp}"')
        run_file = Path(tmp) / "run.toml"
        run_file.write_text(text)
        run = load_run(run_file)
        data = Samples(tokenize(corpus_files(None), run.tokenizer, run.hf_config().vocab_size), run.seq_len, run.seed)
        local = LocalTraining(run, data)
        spans = [str(s) for s in run.stages]
        args_ = ("--throughput", "100", "--train", str(run_file))
        with LocalSwarm("tiny-llama", spans, extra_args=args_) as swarm:
            with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing()) as trainer:
                traffic = trainer.blocks.remote.traffic
                times: dict[str, list[float]] = {"local": [], "swarm": []}
                losses: dict[str, list[float]] = {"local": [], "swarm": []}
                before = {}
                for step in range(args.steps):
                    if step == args.warmup:
                        before = dict(traffic)
                    for name, fn in (("local", local.train_step), ("swarm", trainer.train_step)):
                        t0 = time.perf_counter()
                        losses[name].append(fn())
                        if step >= args.warmup:
                            times[name].append(time.perf_counter() - t0)
                measured = args.steps - args.warmup
                sent = (traffic["sent_bytes"] - before.get("sent_bytes", 0)) / measured
                received = (traffic["received_bytes"] - before.get("received_bytes", 0)) / measured

    tokens = run.target_batch_size * run.seq_len
    t_local, t_swarm = statistics.median(times["local"]), statistics.median(times["swarm"])
    print(f"\n{run.name}: {run.hf_config().num_hidden_layers} layers, hidden {run.hf_config().hidden_size}, "
          f"{len(spans)} stages on 127.0.0.1, batch {run.target_batch_size} x {run.seq_len} tokens "
          f"(micro-batches of {run.micro_batch_size}), 1 torch thread per process")  # fmt: skip
    print(f"| {'metric':<30} | {'local':>9} | {'swarm':>9} | {'ratio':>6} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    print(f"| {'training tokens/s (median)':<30} | {tokens / t_local:>9.0f} | {tokens / t_swarm:>9.0f} | "
          f"{t_local / t_swarm:>5.2f}x |")  # fmt: skip
    print(f"| {'seconds per step (median)':<30} | {t_local:>9.3f} | {t_swarm:>9.3f} | {'':>6} |")
    print(f"\nbytes per token, trainer side, every message: {sent / tokens:.0f} sent, {received / tokens:.0f} received")
    diff = max(abs(a - b) for a, b in zip(losses["local"], losses["swarm"], strict=True))
    print(f"\nloss per step, local vs swarm (largest difference {diff:.1e}):")
    for i in range(0, args.steps, max(args.steps // 10, 1)):
        print(f"  step {i + 1:>4}: {losses['local'][i]:.5f}  {losses['swarm'][i]:.5f}")
    save_plot(args.plot, {"local": losses["local"], "swarm": losses["swarm"]})
    print(f"plot of both loss curves: {args.plot}")


if __name__ == "__main__":
    main()
