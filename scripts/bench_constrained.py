"""What constrained decoding costs per token: SmolLM2-135M through 3 local peers behind ``python -m swarm.api``, the
same chat request streamed with and without a ``json_schema`` response format, alternating, in one run.

    python scripts/bench_constrained.py                 # 8 rounds of 64 tokens each way
    python scripts/bench_constrained.py --rounds 3 --tokens 32

Per request: the time from its first streamed chunk to its last over the tokens between (``usage``), so the prompt's
prefill weighs on neither side; the medians are printed with their ratio (the issue's target: at most 1.10x). Also
the grammar's own cost on this CPU, measured in this process: one mask per token over SmolLM2's 49,152 tokens."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``swarm`` and ``harness``
    sys.path.insert(0, str(ROOT))

from harness.local_swarm import ApiProcess  # noqa: E402
from swarm.launch import LocalSwarm  # noqa: E402

MODEL = "smollm2-135m"
SPANS = ["0:10", "10:20", "20:30"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "story": {"type": "string", "minLength": 400, "maxLength": 2000},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "user", "content": "Write a long story about a lighthouse keeper, as JSON with a title and a story."}
]


def per_token(client: openai.OpenAI, tokens: int, constrained: bool) -> float:
    """Seconds per token after the first, of one streamed greedy answer of exactly ``tokens`` tokens."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **(extra if constrained else {}),
    )
    first = last = 0.0
    produced = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first, last = first or now, now
        if chunk.usage is not None:
            produced = chunk.usage.completion_tokens
    if produced < tokens:
        raise SystemExit(f"an answer ended after {produced} of {tokens} tokens: raise the schema's minLength")
    return (last - first) / (produced - 1)


def mask_cost(steps: int = 2000) -> float:
    """Seconds per token for the grammar alone (mask, apply, advance), on this process's CPU."""
    import torch

    from swarm import load_tokenizer
    from swarm.api.grammar import Vocabulary

    tokenizer = load_tokenizer(MODEL)
    vocab = Vocabulary(tokenizer, len(tokenizer), frozenset({int(tokenizer.eos_token_id)}))
    grammar = vocab.json(SCHEMA, "response_format")
    matcher, logits = vocab.matcher(grammar), torch.randn(len(tokenizer))
    text = '{"title": "The Keeper", "story": "' + "a" * 1500
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:steps]
    t0 = time.perf_counter()
    for t in ids:
        matcher.mask(logits)
        matcher.take(t)
    return (time.perf_counter() - t0) / len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    times: dict[str, list[float]] = {"plain": [], "json_schema": []}
    with LocalSwarm(MODEL, SPANS) as swarm:
        with ApiProcess(swarm.initial_peers, "--model", MODEL, test_timings=False) as api:
            client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=600)
            per_token(client, 8, False)  # warm-up: plans, connections
            per_token(client, 8, True)
            for _ in range(args.rounds):
                times["plain"].append(per_token(client, args.tokens, False))
                times["json_schema"].append(per_token(client, args.tokens, True))
    plain, constrained = statistics.median(times["plain"]), statistics.median(times["json_schema"])
    print(f"\nSmolLM2-135M through {len(SPANS)} peers on 127.0.0.1, greedy, {args.tokens} tokens, {args.rounds} rounds")
    print("| decoding | ms per token (median) | ratio |")
    print("| --- | --- | --- |")
    print(f"| plain | {plain * 1e3:.1f} | 1.00x |")
    print(f"| json_schema (constrained) | {constrained * 1e3:.1f} | {constrained / plain:.2f}x |")
    print(f"\nthe grammar alone (llguidance mask + apply + advance): {mask_cost() * 1e6:.0f} us per token")
    print(f"target (issue 36): at most 1.10x -> {'PASS' if constrained / plain <= 1.10 else 'FAIL'}")


if __name__ == "__main__":
    main()
