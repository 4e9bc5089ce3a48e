"""What ``scripts/bench_serving.py`` runs and computes apart from its swarms: the streams' prompts, the pure
statistics of its rows (percentiles, Jain's index, a row from timed streams) and its two kinds of worker process
(streams through ``swarm.api`` with the ``openai`` client, and separate swarm clients). Only the standard library at
import: the workers import the rest when they run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBJECTS = [
    "a lighthouse keeper",
    "a lost robot",
    "a baker",
    "a sailor",
    "a small fox",
    "an old clockmaker",
    "a young painter",
    "a travelling musician",
]
PLACES = ["in a snowy village", "on a distant island", "in a busy city", "in a quiet forest"]
WARMUP_TRIES = 4


def prompt(i: int) -> str:
    """Stream ``i``'s request: each different, each asking for more text than any run takes."""
    text = f"Write a long story about {SUBJECTS[i % len(SUBJECTS)]} {PLACES[(i // len(SUBJECTS)) % len(PLACES)]}."
    cycle = i // (len(SUBJECTS) * len(PLACES))
    return text if cycle == 0 else f"{text} Call it part {cycle + 1}."


# -- statistics (pure) ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one gets everything."""
    square = sum(v * v for v in values)
    if not values or square == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * square)


def summarize(streams: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One row from its streams' records: ``start`` (request sent), ``times`` (each token's or text chunk's arrival,
    on one monotonic clock shared by every process of this machine) and ``tokens`` (the stream's count)."""
    done = [s for s in streams if s["times"]]
    if len(done) < len(streams):
        raise RuntimeError(f"{len(streams) - len(done)} of {len(streams)} streams got no token")
    start = min(s["start"] for s in done)
    wall = max(s["times"][-1] for s in done) - start
    tokens = sum(s["tokens"] for s in done)
    gaps = [b - a for s in done for a, b in zip(s["times"], s["times"][1:], strict=False)]
    rates = [s["tokens"] / (s["times"][-1] - s["start"]) for s in done]
    return {
        "streams": len(done),
        "tokens": tokens,
        "fewest_tokens": min(s["tokens"] for s in done),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tbt_p50_s": percentile(gaps, 50),
        "tbt_p95_s": percentile(gaps, 95),
        "jain": jain(rates),
        "ttft_p50_s": statistics.median(s["times"][0] - s["start"] for s in done),
    }


# -- workers (child processes, in a WAN node or on this machine's network) -----------------------------------------


def emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def api_worker(spec: dict[str, Any]) -> None:
    """Rounds of ``n`` concurrent streamed chat completions through the API at ``spec['url']``, one thread each,
    released together; one JSON line per round."""
    import openai

    client = openai.OpenAI(base_url=spec["url"] + "/v1", api_key="none", max_retries=0, timeout=spec["timeout"])

    def one(i: int, tokens: int, barrier: threading.Barrier | None = None) -> dict[str, Any]:
        if barrier is not None:
            barrier.wait()
        times: list[float] = []
        count = 0
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=spec["model"],
            messages=[{"role": "user", "content": prompt(i)}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
        return {"start": start, "times": times, "tokens": count}

    def concurrent(n: int) -> tuple[list[dict[str, Any] | None], list[str]]:
        records: list[dict[str, Any] | None] = [None] * n
        errors: list[str] = []
        barrier = threading.Barrier(n)

        def run(i: int) -> None:
            try:
                records[i] = one(i, spec["tokens"], barrier)
            except Exception as e:  # reported, and the round fails in the parent
                errors.append(f"stream {i}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return records, errors

    one(0, 4)  # warm-up: the API's connections and sessions to every server
    for n in spec["rounds"]:
        records, errors = concurrent(n)
        emit(round=n, records=records, errors=errors)
    emit(done=True)


def client_worker(spec: dict[str, Any]) -> None:
    """One swarm client: connect, warm up, print ``{"ready": true}``, then one generation of exactly
    ``spec['tokens']`` tokens per ``go`` line on stdin, until stdin ends."""
    import torch
    from transformers import BatchEncoding

    from harness.wan.client_job import Stamps, connect
    from swarm import load_tokenizer

    torch.set_num_threads(1)  # 16 of them share the cores: more threads each only contend (measured)
    tokenizer = load_tokenizer(spec["model"])
    chat = [{"role": "user", "content": prompt(spec["index"])}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert isinstance(inputs, BatchEncoding)
    n = spec["tokens"]
    gen: dict[str, Any] = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with connect(spec, {}) as model:
        failures: list[str] = []
        while True:  # warm-up: connections, sessions, allocator; not measured, so a failure (a session open
            try:  # timing out while 16 clients start at once on a loaded machine) is retried after the peer's ban
                model.generate(**inputs, max_new_tokens=2, **gen)
                break
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
                if len(failures) == WARMUP_TRIES:
                    raise
                print(f"warm-up failed ({failures[-1]}); again in {20 * len(failures)} s", file=sys.stderr, flush=True)
                time.sleep(20 * len(failures))
        emit(ready=True, warmup_failures=failures)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            stamps = Stamps()
            start = time.perf_counter()
            try:
                model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, streamer=stamps, **gen)
            except Exception as e:  # the row fails and says why; this client stays for the next round
                emit(error=f"{type(e).__name__}: {e}")
                continue
            times = stamps.times[1:]  # the first put is the prompt
            emit(start=start, times=times, tokens=len(times), failovers=model.failovers)
    emit(done=True)


# -- the report ---------------------------------------------------------------------------------------------------


def machine(root: Path) -> dict[str, Any]:
    """The machine and checkout (at ``root``) a run was made on, and the load when it started."""
    import torch

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    mem = ""
    with contextlib.suppress(OSError):
        mem = next((ln.split(":", 1)[1].strip() for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else ""),
        "load_start": os.getloadavg(),
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def measured(r: dict[str, Any] | None) -> bool:
    return r is not None and "failed" not in r


def cell(r: dict[str, Any] | None, one: dict[str, Any] | None, width: int) -> str:
    if r is None:
        return f"{'-':>{width}}"
    if "failed" in r:
        text = f"{r['failed']} of {r['streams']} streams failed"
        return f"{text:>{width}}"
    x = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}" if one is not None and measured(one) else "-"
    text = (
        f"{r['tokens_per_s']:.1f} {x:>5} {r['tbt_p50_s'] * 1000:>7.0f} {r['tbt_p95_s'] * 1000:>7.0f} "
        f"{r['jain']:>6.3f} {r['ttft_p50_s']:>7.2f}"
    )
    return f"{text:>{width}}"


def rule(head: str) -> str:
    return "|" + "|".join("-" * len(p) for p in head.split("|")[1:-1]) + "|"


def fmt_load(load: Sequence[float]) -> str:
    return "/".join(f"{v:.1f}" for v in load)
