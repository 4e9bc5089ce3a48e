"""Accuracy and bytes of each activation codec on SmolLM2-135M, over held-out Python standard-library text.

    python scripts/eval_compression.py                        # 200 prompts x 32 positions, every codec
    python scripts/eval_compression.py --prompts 50 --codecs none float16 block8

The wire is simulated exactly: the local Hugging Face model runs block by block and every hidden state that would
cross the network in a 3-server split (client -> 0:10 -> 10:20 -> 20:30 -> client) goes through the real
``swarm.wire`` encode/decode round trip with the codec, once per message (the prompt's prefill, then each generated
token's step), which is what the swarm does. Text: the ``.py`` files of this Python's standard library, split by file
(a hash of the file name) into train and held-out parts; prompts are windows of held-out files only.

Reports, per codec against the uncompressed path: teacher-forced top-1 agreement over ``--prompts`` x ``--positions``
(the last positions of ``--context`` + ``--positions`` token windows), the greedy match rate (the share of prompts
whose ``--positions`` greedily generated tokens are all identical), the logit error (max and mean absolute
difference), and bytes per token of one boundary's hidden states (a prefill of the window, and a one-token step).
"""

from __future__ import annotations

import argparse
import hashlib
import sysconfig
import time
from pathlib import Path

import torch

from swarm import wire
from swarm.codecs import Codec

BOUNDARIES = (10, 20)  # a 3-server split of 30 blocks: hidden states cross the network before 0, at 10, 20, after 30


def stdlib_split(held_out_share: int = 5) -> tuple[list[Path], list[Path]]:
    """The standard library's top-level modules, split by file name: one in ``held_out_share`` held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    held = [f for f in files if int(hashlib.sha256(f.name.encode()).hexdigest(), 16) % held_out_share == 0]
    return [f for f in files if f not in held], held


def windows(tokenizer: object, files: list[Path], n: int, length: int) -> torch.Tensor:
    """``n`` token windows of ``length``, spread round-robin over ``files`` (at most a few per file)."""
    per_file = [tokenizer(f.read_text(errors="replace"))["input_ids"] for f in files]  # type: ignore[operator]
    out: list[list[int]] = []
    offset = 0
    while len(out) < n:
        before = len(out)
        for ids in per_file:
            start = offset * length
            if start + length <= len(ids) and len(out) < n:
                out.append(ids[start : start + length])
        if len(out) == before:
            raise SystemExit(f"held-out text holds only {len(out)} windows of {length} tokens")
        offset += 1
    return torch.tensor(out)


class Wire:
    """Forward hooks that send every boundary's hidden states through the wire round trip with ``codec``."""

    def __init__(self, model: torch.nn.Module, codec: Codec) -> None:
        self.codec = codec
        self.bytes = 0
        self.handles = []
        inner = model.model  # type: ignore[attr-defined]
        layers = inner.layers
        points = [inner.embed_tokens] + [layers[b - 1] for b in BOUNDARIES] + [layers[len(layers) - 1]]
        for module in points:
            self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> object:
        hidden = output[0] if isinstance(output, tuple) else output
        frames = wire.encode({}, {"hidden": hidden}, self.codec)
        self.bytes += wire.encoded_size(frames)
        back = wire.decode(frames)[1]["hidden"]
        return (back, *output[1:]) if isinstance(output, tuple) else back

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def bytes_per_token(codec: Codec, hidden: torch.Tensor) -> float:
    return wire.encoded_size(wire.encode({}, {"hidden": hidden}, codec)) / hidden.shape[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--positions", type=int, default=32)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--codecs", nargs="+", default=[c.value for c in Codec])
    p.add_argument(
        "--greedy-codecs",
        nargs="*",
        default=["none", "float16", "bfloat16", "block8"],
        help="codecs whose greedy match is measured (generation is the slow part)",
    )
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import load_tokenizer, model_folder

    folder = model_folder(load_model_card("smollm2-135m"), default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    train, held = stdlib_split()
    data = windows(load_tokenizer(folder), held, args.prompts, args.context + args.positions)
    print(
        f"SmolLM2-135M, simulated 3-server wire (boundaries at embed, {BOUNDARIES}, final block); stdlib text: "
        f"{len(train)} train / {len(held)} held-out files; {len(data)} prompts x {args.positions} positions"
    )

    def run(codec: Codec, greedy_too: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        hooks = Wire(model, codec)
        try:
            logits, greedy = [], []
            with torch.no_grad():
                for batch in data.split(args.batch):
                    logits.append(model(batch).logits[:, args.context - 1 : -1])
                    if greedy_too:
                        prompt = batch[:, : args.context]
                        out = model.generate(
                            prompt,
                            attention_mask=torch.ones_like(prompt),
                            do_sample=False,
                            max_new_tokens=args.positions,
                            min_new_tokens=args.positions,
                            pad_token_id=0,
                        )
                        greedy.append(out[:, args.context :])
            return torch.cat(logits), torch.cat(greedy) if greedy else None, hooks.bytes
        finally:
            hooks.close()

    with torch.no_grad():
        hidden = model.model(data[:1]).last_hidden_state  # real activations for the bytes count
    rows = []
    ref_logits: torch.Tensor | None = None
    ref_greedy: torch.Tensor | None = None
    for name in ["none", *[c for c in args.codecs if c != "none"]]:
        codec = Codec(name)
        t0 = time.perf_counter()
        logits, greedy, sent = run(codec, name in args.greedy_codecs)
        seconds = time.perf_counter() - t0
        if ref_logits is None:
            ref_logits, ref_greedy = logits, greedy
        diff = (logits - ref_logits).abs()
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        match = float("nan")
        if greedy is not None and ref_greedy is not None:
            match = (greedy == ref_greedy).all(dim=1).float().mean().item()
        prefill = bytes_per_token(codec, hidden)
        step = bytes_per_token(codec, hidden[:, -1:])
        rows.append((name, top1, match, diff.max().item(), diff.mean().item(), prefill, step, sent, seconds))
        print(f"  {name}: top-1 {top1:.2%}, greedy match {match:.1%}, {seconds:.0f} s", flush=True)
    base_prefill = rows[0][5]
    print(
        f"\n| codec | top-1 agreement | greedy match | max logit err | mean logit err | bytes/token (prefill "
        f"{args.context + args.positions}) | vs float32 | bytes/token (1-token step) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, top1, match, dmax, dmean, prefill, step, _, _ in rows:
        print(
            f"| {name} | {top1:.2%} | {match:.1%} | {dmax:.3f} | {dmean:.4f} | {prefill:.0f} | "
            f"{base_prefill / prefill:.2f}x | {step:.0f} |"
        )


if __name__ == "__main__":
    main()
