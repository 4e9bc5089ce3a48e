"""Speculative decoding through the swarm vs plain chained decoding, in one run: SmolLM2-135M-Instruct over 3
servers (0:10, 10:20, 20:30), on loopback and behind the WAN emulator (``harness.wan``: every server and the client
in its own node, 25 and 50 ms one way between any two, 100 Mbit/s), greedy, for three workloads:

- ``summarise``: summarise a given text (the answer reuses its phrases),
- ``code``: edit a given function and give it back whole (the answer repeats most of it),
- ``chat``: an open question (nothing to copy).

Per link and workload: plain decoding, then each drafter (``ngram``: prompt lookup; ``first:N``: the served model's
first N blocks and head on the client), measured back to back on the same swarm; tokens/s over the decode (time to
the first token left out: it is the same prefill for all), the speedup over plain, tokens per trip and drafts kept.
Every speculative answer must equal the plain one token for token (greedy). Then 16 streams at once (the three
workloads in turn, ngram) with and without speculation: their aggregate tokens/s.

    python scripts/bench_speculative.py                       # loopback, 25 ms, 50 ms (needs root for the WAN)
    python scripts/bench_speculative.py --links loopback --new-tokens 48 --repeats 1
Every process uses one torch thread; servers run with ``--threads 1 --throughput 100``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
SPANS = ["0:10", "10:20", "20:30"]
LINKS = {"loopback": None, "25ms": 25.0, "50ms": 50.0}
MBIT = 100.0

TEXT = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. The plan adds two protected "
    "lanes between the river bridge and the train station, removes forty parking spaces, and moves the bus stop "
    "near the library one block north. Supporters said the lanes would make the street safer for children who "
    "ride to school, and that shops would gain customers who arrive by bike. Several shop owners disagreed. They "
    "said the lost parking spaces would hurt their business, especially in winter, when few people ride. The "
    "council agreed to a six month trial. During the trial, the city will count bicycles, cars and pedestrians "
    "every week, and survey the shop owners about their sales. The council will vote on keeping the lanes in June, "
    "after it has seen the counts and the survey results."
)
CODE = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
"""
WORKLOADS = {
    "summarise": f"Shorten this text to three sentences.\n\n{TEXT}",
    "code": f"Add a docstring to this function. Give back the whole function.\n\n```python\n{CODE}```",
    "chat": "What are some good ways to learn to play the guitar as an adult?",
}


# ---- the client job (inside a WAN node, or a plain child process on loopback) ------------------------------------
class Clock:
    """A streamer that notes when the first new token arrived (``generate`` puts the prompt first)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def job(spec: dict[str, Any]) -> None:
    import torch

    from swarm import DistributedModelForCausalLM, load_tokenizer
    from swarm.client.speculative.loop import Speculation

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(MODEL)
    model = DistributedModelForCausalLM.from_pretrained(MODEL, initial_peers=spec["peers"], codec="none")
    new = spec["new_tokens"]

    def prompt(name: str) -> torch.Tensor:
        chat = [{"role": "user", "content": WORKLOADS[name]}]
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        return torch.tensor([out["input_ids"]])

    def run(ids: torch.Tensor, drafter: str | None) -> tuple[list[int], float, dict[str, Any]]:
        clock = Clock()
        kwargs: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, streamer=clock)
        if drafter is not None:
            kwargs["speculative"] = Speculation(drafter, max_k=spec["max_k"])
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()
        end = time.perf_counter()
        first = clock.first if clock.first is not None else t0
        trace = model.last_speculation if drafter is not None else None
        extra = (
            {}
            if trace is None
            else dict(
                trips=trace.trips,
                drafted=trace.drafted,
                kept=trace.kept,
                t1_ms=round(trace.t1 * 1000, 2),
                t2_ms=round(trace.t2 * 1000, 2),
                slope_ms=round(trace.slope * 1000, 2),
                rates={k: round(v, 2) for k, v in trace.rates.items()},
            )
        )
        return out, (len(out) - 1) / max(end - first, 1e-9), extra

    run(prompt("chat")[:, :8], None)  # warm-up: routes, connections, the drafters' first load
    for drafter in spec["drafters"]:
        run(prompt("chat")[:, :8], drafter)
    for name in spec["workloads"]:
        ids = prompt(name)
        for rep in range(spec["repeats"]):
            plain, plain_tps, _ = run(ids, None)
            print(json.dumps(dict(workload=name, drafter="plain", rep=rep, tps=plain_tps, tokens=len(plain))))
            for drafter in spec["drafters"]:
                out, tps, extra = run(ids, drafter)
                row = dict(workload=name, drafter=drafter, rep=rep, tps=tps, plain_tps=plain_tps, tokens=len(out))
                print(json.dumps({**row, **extra, "same": out == plain}), flush=True)
    if spec["streams"]:
        streams(model, prompt, spec)
    model.close()
    print(json.dumps({"done": True}), flush=True)


def streams(model: Any, prompt: Any, spec: dict[str, Any]) -> None:
    """``streams`` generations at once, the workloads in turn: aggregate tokens/s, plain then speculative."""
    from swarm.client.speculative.loop import Speculation

    n, new = spec["streams"], spec["stream_tokens"]
    names = list(WORKLOADS)
    for drafter in [None, "ngram", None, "ngram"]:  # twice each, interleaved: a drift in the machine hits both
        results: list[list[int]] = [[] for _ in range(n)]
        start = threading.Barrier(n)

        def one(
            i: int,
            drafter: str | None = drafter,
            results: list[list[int]] = results,
            start: threading.Barrier = start,
        ) -> None:
            kwargs: dict[str, Any] = dict(max_new_tokens=new, do_sample=False)
            if drafter is not None:
                kwargs["speculative"] = Speculation(drafter, max_k=spec["max_k"])
            ids = prompt(names[i % len(names)])
            start.wait(120)
            results[i] = model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        total = sum(len(r) for r in results)
        print(json.dumps(dict(streams=n, drafter=drafter or "plain", tps=total / wall, tokens=total)), flush=True)


# ---- the orchestrator ------------------------------------------------------------------------------------------------
def measure(link: str, args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    from harness.wan.nodes import ClientJob
    from swarm.launch import LocalSwarm

    spec = dict(
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        drafters=args.drafters,
        workloads=args.workloads,
        max_k=args.max_k,
        streams=args.streams,
        stream_tokens=args.stream_tokens,
    )
    command = (sys.executable, str(Path(__file__).resolve()), "--job")
    extra = ("--throughput", "100")
    rows: list[dict[str, Any]] = []

    def drive(wan: Any, peers: list[str]) -> None:
        with ClientJob(
            wan,
            "c" if wan is not None else None,
            {**spec, "peers": peers},
            logs / f"client-{link}.log",
            command=command,
        ) as client:
            while (item := client.next(args.job_timeout)) is not None:
                if item.get("done"):
                    break
                rows.append({**item, "link": link})
                print(f"  {link}: {item}", flush=True)

    delay = LINKS[link]
    t0 = time.perf_counter()
    if delay is None:
        with LocalSwarm(MODEL, SPANS, extra_args=(*extra, "--threads", "1"), log_dir=logs / link) as swarm:
            print(f"{link}: servers up in {time.perf_counter() - t0:.0f} s", flush=True)
            drive(None, swarm.initial_peers)
        return rows
    from harness.wan import Wan, WanConfig
    from harness.wan.nodes import WanSwarm

    nodes = ("c", "s1", "s2", "s3")
    with Wan(WanConfig(nodes=nodes, delay_ms=delay, mbit=MBIT)) as wan:
        with WanSwarm(
            wan, MODEL, dict(zip(nodes[1:], SPANS, strict=True)), extra_args=extra, log_dir=logs / link
        ) as sw:
            print(f"{link}: servers up in {time.perf_counter() - t0:.0f} s", flush=True)
            drive(wan, sw.initial_peers)
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n## Speculative decoding, greedy, {args.new_tokens} new tokens (median of {args.repeats})")
    head = (
        f"| {'link':<8} | {'workload':<9} | {'drafter':<8} | {'tok/s':>6} | {'plain':>6} | {'speedup':>7} | "
        f"{'tok/trip':>8} | {'kept':>5} | same |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for link in args.links:
        for workload in WORKLOADS:
            for drafter in args.drafters:
                mine = [
                    r for r in rows if (r.get("link"), r.get("workload"), r.get("drafter")) == (link, workload, drafter)
                ]
                if not mine:
                    continue
                tps = statistics.median(r["tps"] for r in mine)
                plain = statistics.median(r["plain_tps"] for r in mine)
                speed = statistics.median(r["tps"] / r["plain_tps"] for r in mine)
                per_trip = sum(r["tokens"] for r in mine) / max(sum(r["trips"] + 1 for r in mine), 1)
                kept = sum(r["kept"] for r in mine) / max(sum(r["drafted"] for r in mine), 1)
                same = "yes" if all(r["same"] for r in mine) else "NO"
                print(
                    f"| {link:<8} | {workload:<9} | {drafter:<8} | {tps:>6.1f} | {plain:>6.1f} | {speed:>6.2f}x | "
                    f"{per_trip:>8.2f} | {kept:>5.2f} | {same:<4} |"
                )
    many = [r for r in rows if "streams" in r]
    if many:
        print(f"\n## {args.streams} streams at once ({args.stream_tokens} new tokens each, ngram)")
        for link in args.links:
            plain = [r["tps"] for r in many if r["link"] == link and r["drafter"] == "plain"]
            spec = [r["tps"] for r in many if r["link"] == link and r["drafter"] != "plain"]
            if plain and spec:
                p, s = statistics.mean(plain), statistics.mean(spec)
                print(f"| {link:<8} | plain {p:6.1f} tok/s | speculative {s:6.1f} tok/s | {s / p:5.2f}x |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    p.add_argument("--drafters", nargs="+", default=["ngram", "first:16", MODEL])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--job-timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, help="also write every row here")
    args = p.parse_args()
    if args.job:
        job(json.loads(args.job))
        return 0
    logs = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    rows: list[dict[str, Any]] = []
    for link in args.links:
        rows += measure(link, args, logs)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    report(rows, args)
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
