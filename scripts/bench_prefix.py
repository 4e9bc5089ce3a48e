"""A conversation's turns through ``python -m swarm.api``: time to first token per turn with the caller's last session
kept on the servers (``--keep-sessions 2``, the default: only the new tokens are sent and computed) and without it
(``--keep-sessions 0``: every turn sends and computes its whole history), measured in the same run on one local swarm.

    python scripts/bench_prefix.py [--model smollm2-135m] [--turns 10] [--tokens 48] [--json out.json]

Each turn is sent as OpenAI clients send it (the whole history again, with the official ``openai`` client,
streamed, greedy); a turn's user message is a paragraph of about 150 tokens, so the history grows by about 200 tokens
a turn (to about 2,000 at turn 10). Both APIs run in front of the same swarm, alternating turn by turn so drift on
this machine hits both alike; the answers of the two must be equal (greedy), and the kept one's usage must report
the reused tokens. Per turn: the prompt's tokens, those reused, time to first token with and without, and their
ratio. Nothing is asserted beyond the equal answers; numbers are this machine's."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from harness.local_swarm import ApiProcess  # noqa: E402
from swarm.launch import LocalSwarm  # noqa: E402

TOPICS = [
    "rivers",
    "mountains",
    "bread",
    "clocks",
    "bridges",
    "owls",
    "glass",
    "tides",
    "maps",
    "bees",
    "salt",
    "kites",
]


def paragraph(turn: int) -> str:
    """About 150 tokens of user text, different every turn."""
    topic = TOPICS[turn % len(TOPICS)]
    return (
        f"Here are my notes on {topic}, turn {turn}. "
        + " ".join(
            f"Point {i}: {topic} matter in ways people often overlook, and I want to remember it." for i in range(8)
        )
        + f" In one sentence, what is the most surprising thing about {topic}?"
    )


def turn(client: openai.OpenAI, model: str, history: list[dict[str, str]], tokens: int) -> tuple[float, str, int, int]:
    """(time to first token, answer, prompt tokens, cached tokens) of one streamed greedy turn."""
    start, first, parts, usage = time.monotonic(), None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=history,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.monotonic() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert first is not None and usage is not None
    details = usage.prompt_tokens_details
    return first, "".join(parts), usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spans", nargs="+", default=["0:15", "15:30"])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    common = ("--model", args.model, "--codec", "none", "--max-context", "4096", "--keep-idle", "600")
    rows = []
    with LocalSwarm(args.model, args.spans, extra_args=("--cache-tokens", "16384")) as swarm:
        with (
            ApiProcess(swarm.initial_peers, *common, test_timings=False) as kept_api,
            ApiProcess(swarm.initial_peers, *common, "--keep-sessions", "0", test_timings=False) as plain_api,
        ):
            kept = openai.OpenAI(base_url=kept_api.url + "/v1", api_key="none", max_retries=0, timeout=600)
            plain = openai.OpenAI(base_url=plain_api.url + "/v1", api_key="none", max_retries=0, timeout=600)
            warm = [{"role": "user", "content": "Hello"}]
            turn(kept, args.model, warm, 2), turn(plain, args.model, warm, 2)  # noqa: B018 - both paths warm
            history: list[dict[str, str]] = []
            for t in range(1, args.turns + 1):
                history.append({"role": "user", "content": paragraph(t)})
                ttft_plain, answer_plain, prompt, _ = turn(plain, args.model, history, args.tokens)
                ttft_kept, answer_kept, prompt_kept, cached = turn(kept, args.model, history, args.tokens)
                assert answer_kept == answer_plain, (t, answer_kept, answer_plain)
                assert prompt_kept == prompt
                history.append({"role": "assistant", "content": answer_kept})
                rows.append(dict(turn=t, prompt=prompt, cached=cached, kept_s=ttft_kept, plain_s=ttft_plain))
                print(
                    f"turn {t:>2}: prompt {prompt:>5} tokens, {cached:>5} reused; first token {ttft_kept:6.2f} s kept, "
                    f"{ttft_plain:6.2f} s without ({ttft_plain / ttft_kept:.1f}x)",
                    flush=True,
                )
    print(f"\n{args.model}, {len(args.spans)} peers on 127.0.0.1, greedy, {args.tokens} tokens a turn")
    print("| turn | prompt tokens | reused | first token, kept | first token, without | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['turn']} | {r['prompt']} | {r['cached']} | {r['kept_s']:.2f} s | {r['plain_s']:.2f} s "
            f"| {r['plain_s'] / r['kept_s']:.1f}x |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
