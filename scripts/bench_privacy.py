"""What a server learns from the hidden states it is sent, and what the client's ``local_blocks`` option costs.

    python scripts/bench_privacy.py            # SmolLM2-135M, hidden states after 0, 1, 2 and 4 local blocks
    python scripts/bench_privacy.py --quick    # a small text and few steps (the tests run it)

The attack: the server of block N sees the hidden states entering it, after the client's N local blocks (N = 0: the
embeddings). An attacker who knows the public weights trains, for each N, an inverter from those hidden states back to
token ids: a small MLP over a window of positions (t - 1, t, t + 1) whose output is scored against the model's own
frozen tied embedding matrix, trained with a sampled softmax (the batch's tokens and random ones as candidates) on
text disjoint from the test text, and evaluated over the full vocabulary (top-1 and top-10 token recovery).

Text, all of it on this machine (no download): training text is the docstrings of installed packages
(``--train-packages``, read from site-packages); test text is Python's own reference documentation shipped with the
interpreter (``pydoc_data.topics``), another source. The attacker's training features are computed through bfloat16
autocast (2 cores cannot afford a million tokens through four blocks in float32 within minutes); the test features
are exact float32, as the servers receive them.

The cost: decode tokens/s through a local swarm of the same model, the client with 0 and with N local blocks (one swarm,
one client per N, measured alternately in the same run), greedy tokens checked equal. Every process uses one torch
thread. Prints a markdown table."""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path

TRAIN_PACKAGES = ("transformers", "torch", "numpy", "sympy", "matplotlib", "networkx", "hypothesis", "pydantic")
DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)


def docstrings(packages: tuple[str, ...], max_chars: int) -> tuple[list[str], int]:
    """Distinct docstrings of ``packages`` (site-packages, files in sorted order) up to ``max_chars``; and how many
    files were read. Mostly prose: strings with too few letters (tables, code) are left out."""
    import importlib.util

    seen: set[str] = set()
    out: list[str] = []
    total, files = 0, 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for path in sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py")):
            files += 1
            for m in DOCSTRING.finditer(path.read_text(errors="replace")):
                text = " ".join(m.group(1).split())
                letters = sum(c.isalpha() for c in text)
                if len(text) < 40 or letters < 0.6 * len(text) or text in seen:
                    continue
                seen.add(text)
                out.append(text)
                total += len(text)
                if total >= max_chars:
                    return out, files
    return out, files


def test_text() -> list[str]:
    """Python's reference documentation as shipped with the interpreter, topic by topic."""
    from pydoc_data.topics import topics

    return [" ".join(topics[k].split()) for k in sorted(topics)]


def chunks(texts: list[str], encode, seq: int, limit: int) -> list[list[int]]:
    """Consecutive pieces of ``seq`` token ids of the texts (joined by blank lines), at most ``limit`` tokens."""
    ids: list[int] = []
    for text in texts:
        ids += encode(text + "\n\n")
        if len(ids) >= limit + seq:
            break
    n = min(len(ids), limit) // seq
    return [ids[i * seq : (i + 1) * seq] for i in range(n)]


def encoder(folder: Path, vocab: int):
    """The model's tokenizer; for a folder without one (the tests' tiny models), UTF-8 bytes within the vocabulary."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        return lambda text: tok(text, add_special_tokens=False)["input_ids"]
    except (OSError, ValueError, TypeError):
        return lambda text: [b % vocab for b in text.encode()]


def trunk(folder: Path, depth: int):
    """The embeddings and first ``depth`` blocks (no final norm): ``hidden_states[n]`` is what enters block n."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    base = model.get_submodule(model.base_model_prefix)
    base.layers = base.layers[:depth]
    base.config.num_hidden_layers = depth
    base.norm = torch.nn.Identity()
    return base, model.get_input_embeddings().weight.detach()


def hidden_states(base, ids, depths: list[int], exact: bool):
    import torch

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not exact):
        states = base(ids, output_hidden_states=True, use_cache=False).hidden_states
    return {n: states[n].float() for n in depths}


def window(h):
    """[batch, n, d] -> [batch, n, 3d]: each position with the ones before and after it (zeros past the ends)."""
    import torch

    zero = torch.zeros_like(h[:, :1])
    return torch.cat([torch.cat([zero, h[:, :-1]], 1), h, torch.cat([h[:, 1:], zero], 1)], -1)


def make_inverter(d: int, vocab: int, hidden: int):
    import torch

    class Inverter(torch.nn.Module):
        """Window of hidden states -> a vector scored against the (frozen) token embeddings, plus a bias per token."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(3 * d)  # hidden states grow with depth: every depth gets the same scale
            self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))
            self.bias = torch.nn.Parameter(torch.zeros(vocab))

        def forward(self, x):
            return self.mlp(self.norm(x))

    return Inverter()


def train_step(inv, opt, emb, x, y, negatives: int, gen) -> float:
    """Sampled softmax: the batch's own tokens and ``negatives`` random ones are the candidates."""
    import torch

    cand = torch.unique(torch.cat([y, torch.randint(0, emb.shape[0], (negatives,), generator=gen)]))
    target = torch.searchsorted(cand, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = inv(x) @ emb[cand].T + inv.bias[cand]
    loss = torch.nn.functional.cross_entropy(logits.float(), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def evaluate(inv, emb, x, y, block: int = 1024) -> tuple[float, float]:
    """Top-1 and top-10 recovery over the full vocabulary, in float32."""
    import torch

    top1 = top10 = 0
    with torch.no_grad():
        for i in range(0, len(y), block):
            logits = inv(x[i : i + block]) @ emb.T + inv.bias
            best = logits.topk(10, dim=-1).indices
            truth = y[i : i + block, None]
            top1 += int((best[:, :1] == truth).sum())
            top10 += int((best == truth).any(-1).sum())
    return top1 / len(y), top10 / len(y)


def attack(args, folder: Path) -> tuple[dict[int, tuple[float, float]], dict[str, object]]:
    import torch

    from swarm.model_files import load_config

    vocab = int(load_config(folder).vocab_size)
    encode = encoder(folder, vocab)
    t0 = time.perf_counter()
    train_docs, files = docstrings(tuple(args.train_packages), args.train_tokens * 8)
    train = chunks(train_docs, encode, args.seq, args.train_tokens)
    test = chunks(test_text(), encode, args.seq, args.test_tokens)
    info: dict[str, object] = {
        "train_tokens": len(train) * args.seq,
        "train_docstrings": len(train_docs),
        "train_files": files,
        "test_tokens": len(test) * args.seq,
        "text_s": time.perf_counter() - t0,
    }
    depths = args.depths
    base, emb = trunk(folder, max(depths))
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    invs = {n: make_inverter(emb.shape[1], vocab, args.mlp_hidden) for n in depths}
    opts = {n: torch.optim.AdamW(invs[n].parameters(), lr=args.lr, weight_decay=0.0) for n in depths}
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    batches = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    total = len(batches) * args.epochs
    scheds = {n: torch.optim.lr_scheduler.OneCycleLR(opts[n], args.lr, total_steps=total) for n in depths}
    t0 = time.perf_counter()
    losses: dict[int, float] = {}
    for _ in range(args.epochs):  # features are computed again each epoch: memory stays small
        for step, batch in enumerate(batches):
            ids = torch.tensor([train[i] for i in batch])
            states = hidden_states(base, ids, depths, exact=False)
            y = ids.flatten()
            for n in depths:
                x = window(states[n]).flatten(0, 1)
                losses[n] = train_step(invs[n], opts[n], emb, x, y, args.negatives, gen)
                scheds[n].step()
            if step % 50 == 0:
                shown = " ".join(f"N={n}: {v:.2f}" for n, v in losses.items())
                print(f"  step {step}/{len(batches)} {time.perf_counter() - t0:.0f} s; loss {shown}", file=sys.stderr)
    info["train_s"] = time.perf_counter() - t0
    ids = torch.tensor(test)
    states = hidden_states(base, ids, depths, exact=True)
    y = ids.flatten()
    results = {n: evaluate(invs[n].eval(), emb, window(states[n]).flatten(0, 1), y) for n in depths}
    return results, info


def decode_speed(args) -> dict[int, float]:
    """Decode tokens/s of a client with each number of local blocks, through one local swarm, alternately."""
    import torch

    from swarm import DistributedModelForCausalLM
    from swarm.config import default_cache_dir, load_model_card
    from swarm.launch import LocalSwarm
    from swarm.model_files import load_config, model_folder

    layers = int(load_config(model_folder(load_model_card(args.model), default_cache_dir())).num_hidden_layers)
    half = layers // 2
    torch.manual_seed(args.seed)
    prompt = torch.randint(0, 1000, (1, 16))
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    times: dict[int, list[float]] = {n: [] for n in args.depths}
    with LocalSwarm(args.model, [f"0:{half}", f"{half}:{layers}"], extra_args=("--throughput", "100")) as swarm:
        clients = {
            n: DistributedModelForCausalLM.from_pretrained(
                args.model, initial_peers=swarm.initial_peers, local_blocks=n, codec="none"
            )
            for n in args.depths
        }
        try:
            outs = {n: c.generate(prompt, **gen) for n, c in clients.items()}  # warm-up, and the tokens agree
            assert all(torch.equal(o, outs[0]) for o in outs.values()), "local blocks changed the tokens"
            for _ in range(args.repeats):
                for n, client in clients.items():
                    t0 = time.perf_counter()
                    client.generate(prompt, **gen)
                    times[n].append(time.perf_counter() - t0)
        finally:
            for c in clients.values():
                c.close()
    return {n: args.new_tokens / statistics.median(t) for n, t in times.items()}


def table(results, speed: dict[int, float] | None) -> str:
    lines = [
        "| local blocks | what the first server sees | top-1 recovered | top-10 recovered | decode tokens/s | vs 0 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, (top1, top10) in results.items():
        seen = "the embeddings" if n == 0 else f"block {n - 1}'s output"
        tps = f"{speed[n]:.2f}" if speed else "-"
        ratio = f"{speed[n] / speed[0]:.2f}x" if speed and 0 in speed else "-"
        lines.append(f"| {n} | {seen} | {top1:.1%} | {top10:.1%} | {tps} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model card or a Hugging Face folder")
    p.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--train-tokens", type=int, default=1_050_000)
    p.add_argument("--test-tokens", type=int, default=8192)
    p.add_argument("--train-packages", nargs="+", default=list(TRAIN_PACKAGES))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per training step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--negatives", type=int, default=1024)
    p.add_argument("--mlp-hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-speed", action="store_true", help="skip the decode-speed part (no swarm started)")
    p.add_argument("--quick", action="store_true", help="a small text and few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.train_tokens, args.test_tokens, args.batch = 8192, 1024, 8
        args.negatives, args.new_tokens, args.repeats = 256, 4, 1
    if 0 not in args.depths:
        args.depths = [0, *args.depths]
    args.depths = sorted(set(args.depths))
    import torch

    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import model_folder

    torch.set_num_threads(1)
    folder = model_folder(load_model_card(args.model), default_cache_dir())
    t0 = time.perf_counter()
    results, info = attack(args, folder)
    speed = None if args.no_speed else decode_speed(args)
    print(
        f"\n{args.model}: inverter trained on {info['train_tokens']} tokens ({info['train_docstrings']} docstrings of "
        f"{', '.join(args.train_packages)}; {info['train_s']:.0f} s), tested on {info['test_tokens']} tokens of "
        f"Python's reference documentation (pydoc_data); {time.perf_counter() - t0:.0f} s in all, 1 torch thread\n"
    )
    print(table(results, speed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
