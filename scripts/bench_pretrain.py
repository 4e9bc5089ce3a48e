"""Pre-training tokens/s through a local swarm vs the same training in one process, in one run.

    python scripts/bench_pretrain.py                       # configs/runs/tiny-llama.toml, 3 stages, 40 steps each
    python scripts/bench_pretrain.py --steps 100 --plot losses.png

Both sides start from the same per-tensor seeds, read the same samples in the same order and use AdamW with the
same schedule, so their loss curves must coincide (printed side by side, and plotted to a PNG with
matplotlib). Steps alternate
(local, swarm, local, ...) so slow drifts of this machine weigh on both alike; every process uses one torch thread.
Bytes are counted over every message the trainer sent and received.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarm.client.training.local import LocalTraining
from swarm.client.training.trainer import Trainer
from swarm.codecs import parse_codec
from swarm.config import Timing
from swarm.launch import LocalSwarm
from swarm.training.data import Samples, corpus_files, tokenize
from swarm.training.run import load_run

SHIPPED = Path(__file__).parents[1] / "configs" / "runs" / "tiny-llama.toml"


def save_plot(path: Path, losses: dict[str, list[float]], title: str) -> None:
    """Both loss curves on labelled axes (matplotlib, drawn off-screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for (name, values), style in zip(losses.items(), ("-", "--"), strict=False):
        ax.plot(range(1, len(values) + 1), values, style, label=name, linewidth=1.6)
    ax.set_xlabel("global step")
    ax.set_ylabel("training loss (cross-entropy, nats per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=SHIPPED)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3, help="steps of each side not timed")
    p.add_argument("--plot", type=Path, default=Path("pretrain-losses.png"))
    p.add_argument("--codec", default="none", help="the swarm side's activation codec: auto, none, float16, block8...")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (read by validate_model.py)")
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
                trainer.model.connection.remote.codec = parse_codec(args.codec)
                traffic = trainer.model.connection.remote.traffic
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
    print(
        f"\n{run.name}: {run.hf_config().num_hidden_layers} layers, hidden {run.hf_config().hidden_size}, "
        f"{len(spans)} stages on 127.0.0.1, batch {run.target_batch_size} x {run.seq_len} tokens "
        f"(micro-batches of {run.micro_batch_size}), 1 torch thread per process"
    )
    print(f"| {'metric':<30} | {'local':>9} | {'swarm':>9} | {'ratio':>6} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    print(
        f"| {'training tokens/s (median)':<30} | {tokens / t_local:>9.0f} | {tokens / t_swarm:>9.0f} | "
        f"{t_local / t_swarm:>5.2f}x |"
    )
    print(f"| {'seconds per step (median)':<30} | {t_local:>9.3f} | {t_swarm:>9.3f} | {'':>6} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"run": str(args.run), "tokens_per_step": tokens, "local_step_s": t_local, "swarm_step_s": t_swarm},
                indent=1,
            )
        )
    print(f"\nbytes per token, trainer side, every message: {sent / tokens:.0f} sent, {received / tokens:.0f} received")
    diff = max(abs(a - b) for a, b in zip(losses["local"], losses["swarm"], strict=True))
    print(f"\nloss per step, local vs swarm (largest difference {diff:.1e}):")
    for i in range(0, args.steps, max(args.steps // 10, 1)):
        print(f"  step {i + 1:>4}: {losses['local'][i]:.5f}  {losses['swarm'][i]:.5f}")
    last_local, last_swarm = losses["local"][-1], losses["swarm"][-1]
    print(
        f"swarm codec {args.codec}: final loss {last_swarm:.5f} vs local {last_local:.5f}, relative difference "
        f"{abs(last_swarm - last_local) / last_local:.3%}"
    )
    save_plot(
        args.plot,
        {"local (one process)": losses["local"], "swarm (3 stage peers)": losses["swarm"]},
        f"{run.name}: local vs swarm",
    )
    print(f"plot of both loss curves: {args.plot}")


if __name__ == "__main__":
    main()
