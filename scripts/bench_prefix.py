"""Long conversations and shared prompts through ``python -m swarm.api``, measured in the same run on one local swarm.

    python scripts/bench_prefix.py [--model smollm2-135m] [--turns 10] [--tokens 48] [--requests 16] [--json out.json]
    python scripts/bench_prefix.py --wan [--wan-prompt 2000] [--codecs auto none float16 block8]

(a) A conversation's turns, each sent as OpenAI clients send it (the whole history again, with the official
``openai`` client, streamed, greedy); a turn's user message is a paragraph of about 150 tokens, so the history grows
by about 200 tokens a turn (to about 2,000 at turn 10). Three APIs in front of the same swarm, alternating turn by
turn so drift on this machine hits all alike: **kept** (the defaults: the caller's last session stays open on
the servers, only new tokens are sent and computed, and servers keep finished sessions' prefixes), **prefixes**
(``--keep-sessions 0``: every turn sends its whole history, servers compute only what their kept prefixes lack) and
**plain** (``--keep-sessions 0 --no-prefix-cache``: every turn sends and computes everything). Their answers must be
equal (greedy). Per turn: the prompt's tokens, those reported cached, and time to first token of each.

(b) ``--requests`` requests that share a system prompt of about 1,000 tokens, each with its own API key and its own
short question, one after another, both with prefix caching (the default): through an API that shares prefixes
(``--share-prefixes``, and servers started with it) and one that does not (each key's prefixes are private),
alternating. Per request: cached tokens and time to first token of each; the answers must be equal.

(c) ``--wan``: a prompt of ``--wan-prompt`` tokens (2,000) behind the WAN emulator (``scripts/bench_wan.py``: the
client and each of 3 servers in its own node, 50 ms one way, 20 Mbit/s each way; servers on one thread each, chained
steps), its time to first token for each of ``--codecs`` (``auto``: what the client picks per link) against its
floor: the bytes the client sent the first hop (the prompt's hidden states after compression, the bytes every hop
sends on) over the link's rate, plus the compute (one process running the whole model on one thread, same run).
Needs root and /dev/net/tun; run alone, it skips (a) and (b).

Beside them, **local**: the same model in this process (Hugging Face, every core), computing each turn's prompt
past what the kept session had cached, from a KV cache of the rest: what a perfect prefix cache costs, the model's own
growth with the history (attention over a longer past), against which the swarm's turn 10 / turn 1 is read.

Nothing is asserted beyond the equal answers; numbers are this machine's."""

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

Row = dict[str, float]  # one turn or request: its number, prompt tokens, and each API's cached tokens and first token

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


def system_prompt() -> str:
    """About 1,000 tokens of instructions every request of part (b) begins with."""
    rules = " ".join(
        f"Rule {i}: when a question concerns {TOPICS[i % len(TOPICS)]}, answer plainly, cite no source, and keep the "
        f"answer under forty words unless the user asks for more detail about {TOPICS[(i + 5) % len(TOPICS)]}."
        for i in range(24)
    )
    return f"You are a careful assistant for a museum of everyday things. {rules}"


def ask_all(clients: dict[str, openai.OpenAI], model: str, history: list[dict[str, str]], tokens: int, row: Row) -> str:
    """One request through every API: their answers must be equal (greedy); each one's cached tokens and time to
    first token go into ``row``, which is printed; the answer."""
    answers = set()
    for name, client in clients.items():
        ttft, answer, prompt, cached = turn(client, model, history, tokens)
        answers.add(answer)
        row |= {"prompt": prompt, f"{name}_cached": cached, f"{name}_s": ttft}
    assert len(answers) == 1, (row, answers)
    label = ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k in ("turn", "request"))
    print(
        f"{label}: prompt {row['prompt']:>5.0f} tokens; first token "
        + ", ".join(f"{n} {row[f'{n}_s']:.2f} s ({row[f'{n}_cached']:.0f} cached)" for n in clients),
        flush=True,
    )
    return answers.pop()


class Local:
    """The model in this process: the time to the first token of a prompt whose first ``past`` tokens are cached."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from swarm.config import default_cache_dir, load_model_card
        from swarm.model_files import model_folder

        folder = model_folder(load_model_card(model), default_cache_dir())
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def first_token(self, history: list[dict[str, str]], past: int) -> float:
        from transformers import DynamicCache

        ids = self.tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, self.torch.Tensor) else ids["input_ids"]
        past = min(past, ids.shape[1] - 1)
        times = []
        with self.torch.inference_mode():
            for _ in range(2):
                cache = DynamicCache()
                if past:
                    self.model(ids[:, :past], past_key_values=cache, use_cache=True)
                start = time.perf_counter()
                out = self.model(ids[:, past:], past_key_values=cache, use_cache=True, logits_to_keep=1)
                int(out.logits[0, -1].argmax())
                times.append(time.perf_counter() - start)
        return min(times)


def conversation(apis: dict[str, openai.OpenAI], model: str, turns: int, tokens: int, local: Local) -> list[Row]:
    rows: list[Row] = []
    history: list[dict[str, str]] = []
    for t in range(1, turns + 1):
        history.append({"role": "user", "content": paragraph(t)})
        rows.append({"turn": t})
        answer = ask_all(apis, model, history, tokens, rows[-1])
        cached = int(rows[-1]["kept_cached"])
        rows[-1] |= {"local_cached": cached, "local_s": local.first_token(history, cached)}
        print(f"  local, {cached} cached: {rows[-1]['local_s']:.2f} s", flush=True)
        history.append({"role": "assistant", "content": answer})
    return rows


def shared(apis: dict[str, str], model: str, requests: int, tokens: int) -> list[Row]:
    rows: list[Row] = []
    system = system_prompt()
    for r in range(requests):
        clients = {  # each request with a key of its own
            name: openai.OpenAI(base_url=url + "/v1", api_key=f"key-{r:04d}", max_retries=0, timeout=600)
            for name, url in apis.items()
        }
        rows.append({"request": r + 1})
        history = [{"role": "system", "content": system}, {"role": "user", "content": paragraph(100 + r)}]
        ask_all(clients, model, history, tokens, rows[-1])
    return rows


def table(rows: list[Row], key: str, names: list[str]) -> None:
    print(f"| {key} | prompt tokens | " + " | ".join(f"{n}: cached, first token" for n in names) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for r in rows:
        cells = " | ".join(f"{r[f'{n}_cached']:.0f}, {r[f'{n}_s']:.2f} s" for n in names)
        print(f"| {r[key]:.0f} | {r['prompt']:.0f} | {cells} |")


def wan(codecs: list[str], prompt: int) -> None:
    """Part (c): one ``bench_wan.py`` run per codec (link c, chained, the direct plane), each with its own floor."""
    import subprocess
    import tempfile

    mbit = 20.0
    print(f"(c) a {prompt}-token prompt's first token behind 50 ms / {mbit:.0f} Mbit/s links, 3 servers", flush=True)
    rows = []
    for codec in codecs:
        out = Path(tempfile.mkdtemp()) / "wan.json"
        argv = [sys.executable, str(Path(__file__).parent / "bench_wan.py"), "--models", "smollm2-135m"]
        argv += ["--links", "c", "--planes", "direct", "--chain", "on", "--tasks", "ttft"]
        argv += ["--prompt-len", str(prompt), "--codec", codec, "--json", str(out), "--ttft-again"]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        got = json.loads(out.read_text())
        compute = got["local"]["smollm2-135m"]["ttft_s"]
        # the run's own rows of ``codec`` (codec none: the run's default row is it)
        row, again = (
            [r for r in got["results"] if r["task"] == task and r["applied"].get("codec") == codec][-1]
            for task in ("ttft", "ttft_again")
        )
        floor = row["sent_bytes"] * 8 / (mbit * 1e6) + compute
        rows.append((codec, row["sent_bytes"], compute, floor, row["ttft_s"]))
        print(f"  {codec}: {row['ttft_s']:.2f} s, floor {floor:.2f} s: {row['ttft_s'] / floor:.2f}x", flush=True)
        # the same prompt and 64 tokens more in a new session: the first hop's kept prefix claimed, not sent
        cells = f"{again['ttft_s']:.2f} s, sent {again['sent_bytes'] / 1e6:.2f} MB"
        cells += f", {again.get('claimed', 0)} positions claimed, {again.get('reused', 0)} reused on every hop"
        print(f"  {codec}, again +64 tokens: {cells}", flush=True)
    print("| codec | bytes per hop | compute | floor | first token | x floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for codec, sent, compute, floor, ttft in rows:
        cells = f"{sent / 1e6:.2f} MB | {compute:.2f} s | {floor:.2f} s | {ttft:.2f} s | {ttft / floor:.2f}x"
        print(f"| {codec} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spans", nargs="+", default=["0:15", "15:30"])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--wan", action="store_true", help="part (c) only: behind the WAN emulator (root)")
    p.add_argument("--wan-prompt", type=int, default=2000)
    p.add_argument("--codecs", nargs="+", default=["auto", "none", "float16", "block8"])
    args = p.parse_args()
    if args.wan:
        wan(args.codecs, args.wan_prompt)
        return
    common = ("--model", args.model, "--codec", "none", "--max-context", "4096", "--keep-idle", "600")
    keys = tuple(f"key-{r:04d}" for r in range(args.requests))
    keyed = (*common, "--keep-sessions", "0", *(a for k in keys for a in ("--api-key", k)))
    peers = ("--cache-tokens", "16384", "--share-prefixes")
    with LocalSwarm(args.model, args.spans, extra_args=peers) as swarm:
        with (
            ApiProcess(swarm.initial_peers, *common, test_timings=False) as kept,
            ApiProcess(swarm.initial_peers, *common, "--keep-sessions", "0", test_timings=False) as prefixes,
            ApiProcess(
                swarm.initial_peers, *common, "--keep-sessions", "0", "--no-prefix-cache", test_timings=False
            ) as plain,
        ):
            apis = {
                name: openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=600)
                for name, api in (("kept", kept), ("prefixes", prefixes), ("plain", plain))
            }
            for client in apis.values():  # every path warm
                turn(client, args.model, [{"role": "user", "content": "Hello"}], 2)
            talk = conversation(apis, args.model, args.turns, args.tokens, Local(args.model))
        with (
            ApiProcess(swarm.initial_peers, *keyed, "--share-prefixes", test_timings=False) as sharing,
            ApiProcess(swarm.initial_peers, *keyed, test_timings=False) as private,
        ):
            system = shared({"shared": sharing.url, "private": private.url}, args.model, args.requests, args.tokens)
    print(f"\n{args.model}, {len(args.spans)} peers on 127.0.0.1, greedy, {args.tokens} tokens an answer")
    print("\n(a) a conversation, time to first token per turn")
    table(talk, "turn", ["kept", "prefixes", "plain", "local"])
    last, one = talk[-1], talk[0]
    print(
        f"turn {last['turn']:.0f} / turn 1, time to first token: "
        + ", ".join(f"{n} {last[f'{n}_s'] / one[f'{n}_s']:.2f}x" for n in ("kept", "prefixes", "plain", "local"))
    )
    print(f"\n(b) {args.requests} requests sharing a system prompt, one key each")
    table(system, "request", ["shared", "private"])
    if args.json is not None:
        args.json.write_text(json.dumps({"conversation": talk, "shared": system}, indent=1))


if __name__ == "__main__":
    main()
