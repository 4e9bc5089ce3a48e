"""``scripts/bench_serving.py``'s tables and targets, from a run's rows (measured now, or saved with ``--json``).

A run is: the machine it ran on, the rows (``net``, ``mode``, ``path``, ``streams`` and the statistics of
``harness.serving_load.summarize``, or ``failed``), the nets skipped and why, and the ceiling: one process's batched
decode of the same streams (``harness.ceiling``), by stream count. Targets print as PASS/FAIL lines: issue 29's (16
streams over one stream, on every net and path) and issue 60's (the loopback API rows against the ceiling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.serving_load import cell, fmt_load, measured, rule, verdict

MODEL = "smollm2-135m"
SPANS = ("0:10", "10:20", "20:30")
WAN_DELAY_MS, WAN_MBIT = 50.0, 100.0
MANY = 16  # the number of streams the targets are about
TARGETS = {  # (net, path) -> least aggregate tokens/s of 16 streams over one stream's (issue 29)
    ("loopback", "api"): 8.0,
    ("loopback", "processes"): 5.0,
    ("wan", "api"): 8.0,
    ("wan", "processes"): 8.0,
}
# issue 60, loopback API: 16 streams' tokens/s over the ceiling's at 16, one stream's over the ceiling's at 1, and
# 16 streams' p50 time between tokens over one stream's
CEILING_MANY, CEILING_ONE, TBT_MANY = 0.75, 0.85, 2.5


@dataclass
class Run:
    machine: dict[str, Any]
    nets: list[str]
    tokens: int
    threads: int
    batched_args: str
    unbatched_args: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    ceiling: dict[int, dict[str, Any]] = field(default_factory=dict)  # streams -> one process's row
    ceiling_threads: int = 0

    def row(self, net: str, mode: str, path: str, streams: int) -> dict[str, Any] | None:
        match = (net, mode, path, streams)
        return next((r for r in self.rows if (r["net"], r["mode"], r["path"], r["streams"]) == match), None)


def net_name(net: str) -> str:
    if net == "loopback":
        return "loopback (127.0.0.1, no WAN)"
    return f"WAN: 3 hops, {WAN_DELAY_MS:.0f} ms one way between any two nodes, {WAN_MBIT:.0f} Mbit/s per node"


def report(run: Run) -> None:
    m = run.machine
    load = f"{fmt_load(m['load_start'])} at the start, {fmt_load(m['load_end'])} at the end"
    print(
        f"\nMeasured on {m['host']}: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python "
        f"{m['python']}, torch {m['torch']}, commit {m['commit']}; load average {load} (1, 5, 15 min; other "
        "work on this machine included)."
    )
    print(
        f"{MODEL} over 3 peers ({' '.join(SPANS)}), {run.tokens} tokens a stream, greedy, "
        f"{run.threads} torch thread(s) per server and API, 1 per client process. Server flags: "
        "batched = defaults"
        + (f" + {run.batched_args}" if run.batched_args.strip() else "")
        + f", unbatched = {run.unbatched_args.strip() or 'defaults (the same as batched)'}."
    )
    _ceiling_table(run)
    modes = [m for m in ("batched", "unbatched") if any(r["mode"] == m for r in run.rows)]
    for net in run.nets:
        if net in run.skipped:
            print(f"\n## {net_name(net)}: skipped ({run.skipped[net]})")
            continue
        print(f"\n## {net_name(net)}")
        _net_table(run, net, modes)
        for mode in modes:
            for text in targets(run, net, mode) or [f"[{net} {mode}] targets need the 1- and {MANY}-stream rows"]:
                print(text)
    for r in run.rows:
        if not measured(r):
            print(f"failed: {r['net']}/{r['mode']}/{r['path']} x{r['streams']}: {'; '.join(r['errors'])}")
    for r in (r for r in run.rows if measured(r) and r["fewest_tokens"] < run.tokens):
        print(
            f"note: {r['net']}/{r['mode']}/{r['path']} x{r['streams']}: a stream ended after {r['fewest_tokens']} "
            f"of {run.tokens} tokens (EOS): its rows weigh fewer tokens"
        )


def _ceiling_table(run: Run) -> None:
    if not run.ceiling:
        return
    print(
        f"\n## the ceiling: one process, the whole model, the streams decoded as one batch (Hugging Face generate, "
        f"{run.ceiling_threads} torch threads)"
    )
    cols = "tok/s    x1  p50 ms  p95 ms   Jain  TTFT s"
    head = f"| {'streams':>7} | {cols} |"
    print(head)
    print(rule(head))
    for n, r in sorted(run.ceiling.items()):
        print(f"| {n:>7} | {cell(r, run.ceiling.get(1), len(cols))} |")


def _net_table(run: Run, net: str, modes: list[str]) -> None:
    cols = "tok/s    x1  p50 ms  p95 ms   Jain  TTFT s"
    head = f"| {'path':<9} | {'streams':>7} | " + " | ".join(f"{mode}: {cols}" for mode in modes)
    head += " | tok/s b/u |" if len(modes) == 2 else " |"
    head += " x ceiling |" if run.ceiling else ""
    print(head)
    print(rule(head))
    for path in ("api", "processes"):
        for n in sorted({r["streams"] for r in run.rows if r["net"] == net and r["path"] == path}):
            cells = []
            for mode in modes:
                r, one = run.row(net, mode, path, n), run.row(net, mode, path, 1)
                cells.append(cell(r, one, len(mode) + 2 + len(cols)))
            line = f"| {path:<9} | {n:>7} | " + " | ".join(cells)
            if len(modes) == 2:
                b, u = (run.row(net, mode, path, n) for mode in modes)
                ratio = "-"
                if b is not None and u is not None and measured(b) and measured(u):
                    ratio = f"{b['tokens_per_s'] / u['tokens_per_s']:.2f}x"
                line += f" | {ratio:>9}"
            if run.ceiling:
                x = _over_ceiling(run, run.row(net, modes[0], path, n), n)
                line += f" | {'-' if x is None else f'{x:.2f}x':>9}"
            print(line + " |")


def _over_ceiling(run: Run, r: dict[str, Any] | None, n: int) -> float | None:
    top = run.ceiling.get(n)
    if r is None or top is None or not measured(r):
        return None
    return float(r["tokens_per_s"] / top["tokens_per_s"])


def targets(run: Run, net: str, mode: str) -> list[str]:
    """The targets as PASS/FAIL lines, where the rows they compare were measured."""
    out = []
    for path in ("api", "processes"):
        many, one = run.row(net, mode, path, MANY), run.row(net, mode, path, 1)
        if many is None or one is None:
            continue
        tag = f"[{net} {mode} {path}]"
        if not (measured(many) and measured(one)):
            out.append(f"FAIL {tag} streams failed at {MANY if not measured(many) else 1}: no ratio")
            continue
        x = many["tokens_per_s"] / one["tokens_per_s"]
        least = TARGETS[(net, path)]
        out.append(f"{verdict(x >= least)} {tag} {MANY} streams: {x:.2f}x one stream's tokens/s (>= {least:g}x)")
        if path == "api" and net == "loopback":
            t = many["tbt_p50_s"] / one["tbt_p50_s"]
            out.append(f"{verdict(t <= TBT_MANY)} {tag} p50 time between tokens {t:.2f}x one stream's (<= {TBT_MANY}x)")
            out.append(f"{verdict(many['jain'] >= 0.95)} {tag} Jain's index {many['jain']:.3f} (>= 0.95)")
            for n, least_x in ((MANY, CEILING_MANY), (1, CEILING_ONE)):
                c = _over_ceiling(run, many if n == MANY else one, n)
                if c is not None:
                    out.append(
                        f"{verdict(c >= least_x)} {tag} {n} stream(s): {c:.2f}x one process's batch of {n} "
                        f"(>= {least_x}x)"
                    )
    return out
