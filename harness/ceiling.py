"""The machine's own ceiling for serving many at once: one process holding the whole model, Hugging Face's
``generate`` decoding ``n`` streams' prompts as one batch (greedy, KV cache, left-padded), with ``threads`` torch
threads. Every layer and the head are computed once per token either way, so what a swarm on the same machine gives
below this is its own cost. ``scripts/bench_serving.py`` runs it in a process of its own (its thread count its own,
nothing else running) and puts its rows beside the swarm's, timed the same way: a stream's tokens are the steps'
ends (a logits processor is called once per step), from the batch's start.

    python -m harness.ceiling --model smollm2-135m --streams 1 16 --tokens 32 --threads 2

prints one JSON line per stream count, ``{"streams": n, "records": [...]}``, in the records' format of
``harness.serving_load.summarize``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from harness.serving_load import prompt


def batch_records(model: Any, tokenizer: Any, n: int, tokens: int) -> list[dict[str, Any]]:
    """``n`` streams decoded as one batch: each stream's start and the time of each of its tokens."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(i)}], tokenize=False, add_generation_prompt=True
        )
        for i in range(n)
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    ends: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            ends.append(time.perf_counter())
            return scores

    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            **batch,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([Clock()]),
        )
    return [{"start": start, "times": list(ends), "tokens": len(ends)} for _ in range(n)]


def run(model_name: str, streams: Sequence[int], tokens: int, threads: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import model_folder

    torch.set_num_threads(threads)
    folder = model_folder(load_model_card(model_name), default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train(False)  # inference: no dropout
    batch_records(model, tokenizer, 2, 4)  # warm-up
    for n in streams:
        print(json.dumps({"streams": n, "records": batch_records(model, tokenizer, n, tokens)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    run(a.model, a.streams, a.tokens, a.threads)


if __name__ == "__main__":
    main()
