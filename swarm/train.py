"""``python -m swarm.train RUN.toml --initial-peers MADDR --data PATH``: a trainer of a pre-training run.

It owns the embeddings, final norm and LM head (trainable), reads the text at ``--data`` (a file or a folder; by
default the Python standard library's own modules), and drives micro-batches forward and backward through the
swarm's stages, printing each step's loss (and, on a terminal, a bar of tokens/s). It checkpoints every
``[checkpoint] every_steps`` and resumes from its last checkpoint (parameters, optimizer, data position) when started
again."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from swarm.config import Timing
from swarm.errors import BadInputError, run_command
from swarm.hub import add_token_flag, use_token
from swarm.logs import add_log_flags, configure_logging, progress_bars


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.train", description=__doc__)
    p.add_argument("run", help="the run's TOML file (see configs/runs/)")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    p.add_argument("--data", type=Path, default=None, help="a text file or folder (default: Python's own modules)")
    p.add_argument("--shard", default="0/1", help="K/N: with N trainers on the same text, this one reads share K")
    p.add_argument("--steps", type=int, default=None, help="stop after this many global steps (default: the run's)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: the run's checkpoint dir / trainer")
    p.add_argument("--cache-dir", type=Path, default=None, help="converted models (default ~/.cache/swarm)")
    p.add_argument(
        "--identity",
        type=Path,
        default=None,
        help="identity file (created if missing): a stable peer id, which a closed run lists",
    )
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    p.add_argument(
        "--client-mediated",
        action="store_true",
        help="pass each micro-batch through this trainer between stages (default: from stage to stage)",
    )
    p.add_argument("--test-timings", action="store_true", help=argparse.SUPPRESS)
    add_token_flag(p)
    add_log_flags(p, "WARNING")
    args = p.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    use_token(args.token)

    return run_command(lambda: _train(args))


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise BadInputError(f"--shard takes K/N (this trainer's share K of N), got {text!r}") from None
    return k, n


def _train(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from swarm.client.training.trainer import Trainer
    from swarm.training.data import Samples, corpus_files, tokenize
    from swarm.training.run import load_run

    torch.set_num_threads(1)
    run = load_run(args.run, args.cache_dir)
    vocab = run.hf_config().vocab_size
    k, n = _shard(args.shard)
    data = Samples(tokenize(corpus_files(args.data), run.tokenizer, vocab), run.seq_len, run.seed, (k, n))
    timing = Timing.for_tests() if args.test_timings else Timing()
    peers = tuple(args.initial_peers)
    ckpt = args.checkpoint_dir
    with Trainer(
        run,
        data,
        peers,
        timing=timing,
        checkpoint_dir=ckpt,
        identity=args.identity,
        swarm_key=args.swarm_key,
        chain=not args.client_mediated,
    ) as trainer:
        total = args.steps if args.steps is not None else run.total_steps
        # a bar only on a terminal with text logs (the step line below says the same to a log)
        bar = tqdm(total=total, initial=min(trainer.step, total), unit="step", disable=not progress_bars())
        while trainer.step < total:
            t0 = time.perf_counter()
            loss = trainer.train_step()
            tokens = run.target_batch_size * run.seq_len / (time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens:.0f}")
            print(f"step {trainer.step} loss {loss:.6f}", flush=True)  # the bar goes to stderr; a log line here
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
