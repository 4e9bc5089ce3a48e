"""Fine-tune a LoRA adapter (or trainable prompts) on a text file through the swarm, and save it in the PEFT format.

    python scripts/finetune.py --data notes.txt --out my-adapter            # starts its own 3-peer local swarm
    python scripts/finetune.py --initial-peers MADDR --data notes.txt       # or trains through a running swarm
    python scripts/finetune.py --tuning prompt --num-prompt-tokens 16 ...

The servers' weights stay frozen; the adapter and the optimizer live here. Without ``--data`` it trains on the
Python license text that every Python installation ships. The saved folder loads back with
``DistributedModelForCausalLM.from_pretrained(..., adapter=FOLDER)`` or into a local model with ``peft``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

from swarm import DistributedModelForCausalLM, load_tokenizer
from swarm.config import default_cache_dir, load_model_card
from swarm.launch import LocalSwarm
from swarm.logs import configure_logging, progress_bars
from swarm.model_files import load_config, model_folder


def default_text() -> Path:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.exists():
        raise SystemExit("no --data given and this Python ships no LICENSE.txt; pass --data FILE")
    return path


def batches(ids: torch.Tensor, batch: int, seq: int, steps: int, seed: int):
    """Random windows of the token stream, the same for a given seed."""
    if ids.numel() <= seq + 1:
        raise SystemExit(f"the text has only {ids.numel()} tokens; give at least {seq + 2}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--initial-peers", nargs="*", default=[], help="join this swarm (default: start a local one)")
    p.add_argument("--peers", type=int, default=3, help="size of the local swarm when no --initial-peers")
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("adapter"))
    p.add_argument("--tuning", default="lora", choices=["lora", "prompt", "deep_prompt"])
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=8.0)
    p.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    p.add_argument("--num-prompt-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    configure_logging("WARNING")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    text = (args.data or default_text()).read_text(errors="replace")
    tokenizer = load_tokenizer(args.model)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    print(f"{len(text)} characters, {ids.numel()} tokens of training text")

    with contextlib.ExitStack() as stack:
        peers = args.initial_peers
        if not peers:
            n = load_config(model_folder(load_model_card(args.model), default_cache_dir())).num_hidden_layers
            cuts = [round(i * n / args.peers) for i in range(args.peers + 1)]
            spans = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
            print(f"starting {args.peers} local peers serving blocks {', '.join(spans)} ...", flush=True)
            peers = stack.enter_context(LocalSwarm(args.model, spans)).initial_peers
        model = stack.enter_context(
            DistributedModelForCausalLM.from_pretrained(
                args.model,
                initial_peers=peers,
                tuning=args.tuning,
                lora_rank=args.lora_rank,
                lora_alpha=args.lora_alpha,
                lora_targets=tuple(args.lora_targets),
                num_prompt_tokens=args.num_prompt_tokens,
            )
        )
        params = [q for q in model.parameters() if q.requires_grad]
        print(f"training {sum(q.numel() for q in params):,} parameters ({args.tuning}); the model's own are frozen")
        opt = torch.optim.AdamW(params, lr=args.lr)
        steps = batches(ids, args.batch, args.seq, args.steps, args.seed)
        bar = tqdm(steps, total=args.steps, unit="step", disable=not progress_bars())  # a bar only on a terminal
        first = None
        for batch in bar:  # each step is the fine-tuning plan: forward, loss, backward, the optimizer's update
            loss = model.train_step(batch, opt)
            first = loss if first is None else first
            bar.set_postfix(loss=f"{loss:.3f}")
        model.save_adapter(args.out)
        traffic = model.traffic
        print(
            f"loss {first:.3f} -> {loss:.3f}; adapter saved to {args.out}/ (PEFT format); "
            f"sent {traffic['sent_bytes'] / 1e6:.1f} MB, received {traffic['received_bytes'] / 1e6:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
