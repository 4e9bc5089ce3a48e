"""What the HTTP API costs over the Python client, measured in the same run on the same local swarm.

    python scripts/bench_api.py [--model smollm2-135m] [--tokens 32] [--rounds 3] [--concurrent 4]

Prints, for greedy decoding of the same prompt: time to first token and per-token time through
``DistributedModelForCausalLM.generate`` (the reference) and through ``python -m swarm.api`` streamed over HTTP with
the ``openai`` client, and their ratios; then the aggregate tokens/s of ``--concurrent`` streams at once against one
stream at a time (the servers batch nothing across sessions: the ratio shows how well the swarm overlaps them)."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import openai
import torch
from transformers import BatchEncoding

from harness.local_swarm import ApiProcess
from swarm import DistributedModelForCausalLM, load_tokenizer
from swarm.config import Timing
from swarm.launch import LocalSwarm

PROMPT = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]


class _Clock:
    """A streamer that records when each new token arrived (generate's first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def _summary(start: float, times: list[float]) -> tuple[float, float]:
    """(time to first token, median time per later token)."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return times[0] - start, statistics.median(gaps)


def direct(model: DistributedModelForCausalLM, inputs: BatchEncoding, tokens: int) -> tuple[float, float]:
    clock = _Clock()
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=clock)
    return _summary(start, clock.times)


def over_http(client: openai.OpenAI, model: str, tokens: int) -> tuple[float, float, int]:
    times: list[float] = []
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return (*_summary(start, times), len(times))


def concurrent(client: openai.OpenAI, model: str, tokens: int, n: int) -> float:
    """Aggregate completion tokens/s of ``n`` requests at once."""
    counts: list[int] = []

    def one() -> None:
        reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=tokens, temperature=0)
        counts.append(reply.usage.completion_tokens if reply.usage else 0)

    threads = [threading.Thread(target=one) for _ in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spans", nargs="+", default=["0:15", "15:30"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert isinstance(inputs, BatchEncoding)
    with LocalSwarm(args.model, args.spans, test_timings=True) as swarm:
        api_args = (
            "--model",
            args.model,
            "--codec",
            "none",
            "--max-concurrent",
            str(max(args.concurrent, 8)),
            "--max-client-concurrent",
            str(max(args.concurrent, 4)),
        )
        with (
            ApiProcess(swarm.initial_peers, *api_args) as api,
            DistributedModelForCausalLM.from_pretrained(
                args.model, initial_peers=swarm.initial_peers, timing=Timing.for_tests(), codec="none"
            ) as model,
        ):
            client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)
            over_http(client, args.model, 4)  # warm both paths
            direct(model, inputs, 4)
            rows: dict[str, list[tuple[float, float]]] = {"python client": [], "HTTP API (streamed)": []}
            for _ in range(args.rounds):  # alternating, so drift on this machine hits both alike
                rows["python client"].append(direct(model, inputs, args.tokens))
                ttft, per_token, n = over_http(client, args.model, args.tokens)
                assert n >= args.tokens // 2, f"the answer ended after {n} tokens: use a longer prompt"
                rows["HTTP API (streamed)"].append((ttft, per_token))
            single = concurrent(client, args.model, args.tokens, 1)
            many = concurrent(client, args.model, args.tokens, args.concurrent)
    ref_ttft = statistics.median(r[0] for r in rows["python client"])
    ref_tok = statistics.median(r[1] for r in rows["python client"])
    print(
        f"{args.model}, {len(args.spans)} peers on 127.0.0.1, greedy, {args.tokens} tokens, medians of "
        f"{args.rounds} rounds"
    )
    print(f"{'path':<22} {'first token ms':>15} {'per token ms':>13} {'ratio ttft':>11} {'ratio token':>12}")
    for name, values in rows.items():
        ttft = statistics.median(v[0] for v in values)
        tok = statistics.median(v[1] for v in values)
        print(f"{name:<22} {ttft * 1000:>15.1f} {tok * 1000:>13.1f} {ttft / ref_ttft:>10.2f}x {tok / ref_tok:>11.2f}x")
    print(
        f"{args.concurrent} requests at once: {many:.1f} tokens/s against {single:.1f} one at a time "
        f"({many / single:.2f}x)"
    )


if __name__ == "__main__":
    main()
