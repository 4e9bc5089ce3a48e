"""Many people at once: SmolLM2-135M over 3 peers (0:10, 10:20, 20:30) serving concurrent streams, batched (the
servers' default flags) and unbatched (``--unbatched-args``) in the same run, on loopback and behind the WAN emulator.

    python scripts/bench_serving.py --quick                 # smoke run: loopback, 1 and 4 streams, 12 tokens (~6 min)
    python scripts/bench_serving.py                         # everything below: 4 swarms, 30-60 min on 2 cores (*)
    python scripts/bench_serving.py --nets loopback --streams 1 4 16 --processes 1 16 --json out.json
    python scripts/bench_serving.py --unbatched-args ""     # before servers have --max-batch: same flags twice

Two ways of being many:
  api        one ``python -m swarm.api`` in front of the swarm, and 1, 4, 16, 32 streams at once through it with the
             ``openai`` client (chat completions, streamed, greedy, ``max_tokens`` = ``--tokens``; the prompts ask for
             long stories, so answers run to ``max_tokens``: the tables show the fewest tokens a stream got).
  processes  separate client processes, each its own swarm client (``DistributedModelForCausalLM``, its own identity,
             DHT peer and sessions) generating exactly ``--tokens`` tokens (EOS ignored); all connect and warm up
             first, then one generates alone and then all of them at once.
Every stream has a prompt of its own. Per row: aggregate tokens/s (every stream's tokens over the wall time from the
first request to the last token), p50 and p95 time between tokens (pooled over all streams' consecutive tokens; on
the API path, between streamed chunks that carry text), Jain's fairness index of the per-stream rates (a stream's
tokens over its own time from request to last token), median time to first token, and ``x1``: aggregate tokens/s
over the same path's one-stream row. Targets (issue 29) print as PASS/FAIL lines; nothing is asserted.

Nets: ``loopback`` (127.0.0.1) and ``wan``: the client side (the API and its load, or the client processes) in one
WAN node and each server in its own, 50 ms one way between any two, 100 Mbit/s per node (``harness.wan``; needs
root, /dev/net/tun and ``ip``, else the WAN rows are skipped with the reason). Servers and the API use ``--threads``
torch threads (1 by default; 2 lets a server's batched forward use both cores of this machine while the others wait),
each client process one (16 of them share the cores: with 2 threads in every process, 16 processes gave 1.65x one
process's tokens/s, against 2.9x with 1 thread everywhere in an earlier run). Servers start with ``--throughput 100``
(no probe) and per-caller limits raised so the API, one caller to the servers, may hold every stream's session.
Default timings (not the tests' short ones): a loaded step may be slow.

(*) Measured on 2 cores shared with other work (load average 4-15), before batching: the quick run 6 min; one
loopback swarm with 1, 4, 16 streams and 1, 16 processes 11 min, of which 4 min went to starting the 16 client
processes (13 s of CPU each for imports alone) and 2 min to the 16-stream rows. Unbatched rows are the slow ones:
32 streams of 32 tokens at ~5 tokens/s take over 3 min. ``--nets``, ``--modes``, ``--paths`` run a part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``swarm`` and ``harness`` (the workers import them from here too)
    sys.path.insert(0, str(ROOT))

from harness.serving_load import (  # noqa: E402
    api_worker,
    cell,
    client_worker,
    fmt_load,
    machine,
    measured,
    rule,
    summarize,
    verdict,
)

MODEL = "smollm2-135m"
SPANS = {"s1": "0:10", "s2": "10:20", "s3": "20:30"}  # WAN node -> span; on loopback the same spans
WAN_DELAY_MS, WAN_MBIT = 50.0, 100.0
PROMPT_TOKENS = 64  # at most, with the chat template: sizes the servers' KV-cache budget
WORKER = (sys.executable, str(Path(__file__).resolve()), "--worker")
TARGETS = {  # (net, path) -> least aggregate tokens/s of 16 streams over one stream's (issue 29)
    ("loopback", "api"): 8.0,
    ("loopback", "processes"): 5.0,
    ("wan", "api"): 8.0,
    ("wan", "processes"): 8.0,
}
MANY = 16  # the number of streams the targets are about
# -- the run -------------------------------------------------------------------------------------------------------


def server_flags() -> set[str]:
    from swarm.serve import build_parser

    return {s for action in build_parser()._actions for s in action.option_strings}


def check_flags(label: str, args: Sequence[str], known: set[str]) -> None:
    """Refuse flags the servers of this checkout lack: argparse would take ``--max-batch`` for ``--max-batch-tokens``
    (a prefix of it), silently benchmarking something else."""
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        raise SystemExit(
            f"{label}: swarm.serve has no {', '.join(unknown)} in this checkout (give e.g. --unbatched-args '')"
        )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
        self.rows: list[dict[str, Any]] = []
        self.machine = machine(ROOT)
        self.modes = {"batched": shlex.split(args.batched_args), "unbatched": shlex.split(args.unbatched_args)}
        self.skipped: dict[str, str] = {}

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def server_args(self) -> tuple[str, ...]:
        """Room for every stream: the API is one caller to the servers and holds all of its streams' sessions."""
        a = self.args
        most = max([*a.streams, *a.processes, 1])
        per_stream = PROMPT_TOKENS + a.tokens + 8
        cache = max(8192, 2 * most * per_stream + max([*a.processes, 0]) * per_stream)  # a caller may hold half
        sessions = 2 * most + 8
        return (
            "--throughput",
            "100",
            "--cache-tokens",
            str(cache),
            "--max-sessions",
            str(max(128, 2 * sessions)),
            "--max-caller-sessions",
            str(sessions),
            "--max-queued",
            str(max(256, 4 * sessions)),
            "--max-caller-queued",
            str(sessions),
        )

    @contextlib.contextmanager
    def swarm(self, wan: Any, mode: str, logs: Path) -> Iterator[list[str]]:
        from harness.wan.nodes import WanSwarm
        from swarm.launch import LocalSwarm

        extra = (*self.server_args(), *self.modes[mode], "--threads", str(self.args.threads))
        t0 = time.perf_counter()
        if wan is None:
            with LocalSwarm(MODEL, list(SPANS.values()), extra_args=extra, log_dir=logs) as sw:
                self.log(f"  3 servers up in {time.perf_counter() - t0:.0f} s")
                yield sw.initial_peers
        else:
            with WanSwarm(wan, MODEL, dict(SPANS), extra_args=extra, log_dir=logs) as sw:
                self.log(f"  3 servers up in {time.perf_counter() - t0:.0f} s")
                yield sw.initial_peers

    def plan(self, counts: Sequence[int]) -> list[int]:
        """The rounds to run: each count once, one stream ``--one-repeats`` times (every target divides by it)."""
        return [n for n in counts for _ in range(self.args.one_repeats if n == 1 else 1)]

    def record(
        self,
        net: str,
        mode: str,
        path: str,
        n: int,
        repeats: list[list[dict[str, Any]]],
        errors: list[str],
        **extra: Any,
    ) -> None:
        """A row from one or more repeats of a round: the repeat of median aggregate tokens/s; or, where any stream
        failed (a step timing out on an overloaded server, say), a failed row that says why, and the run goes on."""
        if errors:
            self.rows.append(dict(net=net, mode=mode, path=path, streams=n, failed=len(errors), errors=errors[:3]))
            self.log(f"  {path} x{n}: {len(errors)} streams failed, e.g. {errors[0]}")
            if self.args.json:
                self.save()
            return
        rows = sorted((summarize(streams) for streams in repeats), key=lambda r: r["tokens_per_s"])
        row = dict(net=net, mode=mode, path=path, **rows[(len(rows) - 1) // 2], **extra)
        if len(rows) > 1:
            row["repeats_tokens_per_s"] = [r["tokens_per_s"] for r in rows]
        self.rows.append(row)
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in rows)
        also = f" (median of {each})" if len(rows) > 1 else ""
        self.log(
            f"  {path} x{row['streams']}: {row['tokens_per_s']:.1f} tokens/s{also}, time between tokens p50 "
            f"{row['tbt_p50_s'] * 1000:.0f} ms p95 {row['tbt_p95_s'] * 1000:.0f} ms, Jain {row['jain']:.3f}, "
            f"fewest tokens {row['fewest_tokens']}"
        )
        if self.args.json:
            self.save()

    def api_rounds(self, wan: Any, net: str, mode: str, peers: list[str], logs: Path) -> None:
        from harness.local_swarm import ApiProcess
        from harness.wan.nodes import ClientJob

        a = self.args
        most = max(a.streams)
        api_args = ["--model", MODEL, "--threads", str(a.threads), "--max-concurrent", str(most)]
        api_args += ["--max-client-concurrent", str(most)]
        prefix = wan.argv("c", []) if wan is not None else []
        node = "c" if wan is not None else None
        done: dict[int, list[list[dict[str, Any]]]] = {}
        failed: dict[int, list[str]] = {}
        with ApiProcess(peers, *api_args, test_timings=False, log_path=logs / "api.log", prefix=prefix) as api:
            rounds = self.plan(a.streams)
            spec = dict(kind="api", url=api.url, model=MODEL, rounds=rounds, tokens=a.tokens, timeout=a.timeout)
            with ClientJob(wan, node, spec, log_path=logs / "api-load.log", command=WORKER) as job:
                while (item := job.next(a.timeout)) is not None and not item.get("done"):
                    n = item["round"]
                    done.setdefault(n, []).append(item["records"])
                    failed.setdefault(n, []).extend(item["errors"])
                    if len(done[n]) == rounds.count(n):
                        self.record(net, mode, "api", n, done[n], failed[n])

    def process_rounds(self, wan: Any, net: str, mode: str, peers: list[str], logs: Path) -> None:
        from harness.wan.nodes import ClientJob

        a = self.args
        node = "c" if wan is not None else None
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            jobs = []
            for i in range(max(a.processes)):
                spec = dict(kind="client", model=MODEL, initial_peers=peers, index=i, tokens=a.tokens)
                log = logs / f"client-{i}.log"
                jobs.append(stack.enter_context(ClientJob(wan, node, spec, log_path=log, command=WORKER)))
            retried = 0
            for job in jobs:
                while not (item := job.next(a.timeout) or {}).get("ready"):
                    if not item:
                        raise RuntimeError(f"a client process exited before it was ready; log: {job.log_path}")
                retried += bool(item["warmup_failures"])
            also = f" ({retried} after a failed warm-up: see their logs)" if retried else ""
            self.log(f"  {len(jobs)} client processes connected and warm in {time.perf_counter() - t0:.0f} s{also}")
            rounds = self.plan(a.processes)
            done: dict[int, list[list[dict[str, Any]]]] = {}
            failed: dict[int, list[str]] = {}
            for n in rounds:
                for job in jobs[:n]:
                    job.resume()  # "go": the cues go out within microseconds of each other
                records = [job.next(a.timeout) for job in jobs[:n]]
                if any(r is None for r in records):
                    raise RuntimeError(f"a client process exited mid-run; logs in {logs}")
                done.setdefault(n, []).append([r for r in records if r is not None and "error" not in r])
                failed.setdefault(n, []).extend(
                    f"process {i}: {r['error']}" for i, r in enumerate(records) if r and "error" in r
                )
                if len(done[n]) == rounds.count(n):
                    failovers = sum(r["failovers"] for streams in done[n] for r in streams)
                    extra = dict(failovers=failovers, warmups_retried=retried)
                    self.record(net, mode, "processes", n, done[n], failed[n], **extra)
            for job in jobs:  # end of input: each leaves its sessions and DHT normally
                assert job.proc.stdin is not None
                job.proc.stdin.close()
            for job in jobs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.proc.wait(60)

    def measure(self, net: str, wan: Any) -> None:
        for mode in self.args.modes:
            logs = self.tmp / f"{net}-{mode}"
            logs.mkdir(parents=True, exist_ok=True)
            self.log(f"{net} / {mode} (server flags: {' '.join(self.modes[mode]) or 'defaults'})")
            with self.swarm(wan, mode, logs) as peers:
                if "api" in self.args.paths and self.args.streams:
                    self.api_rounds(wan, net, mode, peers, logs)
                if "processes" in self.args.paths and self.args.processes:
                    self.process_rounds(wan, net, mode, peers, logs)

    def run(self) -> None:
        from harness.wan import Wan, WanConfig, unavailable_reason

        for net in self.args.nets:
            if net == "loopback":
                self.measure(net, None)
                continue
            reason = unavailable_reason()
            if reason is not None:
                self.skipped[net] = reason
                self.log(f"WAN rows skipped: {reason}")
                continue
            with Wan(WanConfig(nodes=("c", *SPANS), delay_ms=WAN_DELAY_MS, mbit=WAN_MBIT)) as wan:
                self.measure(net, wan)

    @classmethod
    def saved(cls, path: Path) -> Bench:
        """A finished run, from its ``--json`` file."""
        data = json.loads(path.read_text())
        c = data["config"]
        args = argparse.Namespace(
            tokens=c["tokens"],
            threads=c.get("threads", 1),
            nets=list(dict.fromkeys(r["net"] for r in data["rows"])) + list(data["skipped"]),
            batched_args=shlex.join(c["modes"]["batched"]),
            unbatched_args=shlex.join(c["modes"]["unbatched"]),
        )
        bench = cls.__new__(cls)
        bench.args, bench.rows, bench.skipped, bench.machine = args, data["rows"], data["skipped"], data["machine"]
        return bench

    def save(self) -> None:
        a = self.args
        self.machine["load_end"] = os.getloadavg()
        config = dict(
            model=MODEL,
            spans=list(SPANS.values()),
            tokens=a.tokens,
            threads=a.threads,
            server_args=self.server_args(),
            modes=self.modes,
            wan=dict(delay_ms=WAN_DELAY_MS, mbit=WAN_MBIT),
        )
        a.json.write_text(
            json.dumps(dict(machine=self.machine, config=config, rows=self.rows, skipped=self.skipped), indent=1)
        )

    # -- the report ----------------------------------------------------------------------------------------------

    def row(self, net: str, mode: str, path: str, streams: int) -> dict[str, Any] | None:
        match = (net, mode, path, streams)
        return next((r for r in self.rows if (r["net"], r["mode"], r["path"], r["streams"]) == match), None)

    def report(self) -> None:
        m = self.machine
        load = f"{fmt_load(m['load_start'])} at the start, {fmt_load(m['load_end'])} at the end"
        print(
            f"\nMeasured on {m['host']}: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python "
            f"{m['python']}, torch {m['torch']}, commit {m['commit']}; load average {load} (1, 5, 15 min; other "
            "work on this machine included)."
        )
        print(
            f"{MODEL} over 3 peers ({' '.join(SPANS.values())}), {self.args.tokens} tokens a stream, greedy, "
            f"{self.args.threads} torch thread(s) per server and API, 1 per client process. Server flags: "
            "batched = defaults"
            + (f" + {self.args.batched_args}" if self.args.batched_args.strip() else "")
            + f", unbatched = {self.args.unbatched_args.strip() or 'defaults (the same as batched)'}."
        )
        modes = [m for m in ("batched", "unbatched") if any(r["mode"] == m for r in self.rows)]
        for net in self.args.nets:
            if net in self.skipped:
                print(f"\n## {net_name(net)}: skipped ({self.skipped[net]})")
                continue
            print(f"\n## {net_name(net)}")
            cols = "tok/s    x1  p50 ms  p95 ms   Jain  TTFT s"
            head = f"| {'path':<9} | {'streams':>7} | " + " | ".join(f"{mode}: {cols}" for mode in modes)
            head += " | tok/s b/u |" if len(modes) == 2 else " |"
            print(head)
            print(rule(head))
            for path in ("api", "processes"):
                counts = sorted({r["streams"] for r in self.rows if r["net"] == net and r["path"] == path})
                for n in counts:
                    cells = []
                    for mode in modes:
                        r, one = self.row(net, mode, path, n), self.row(net, mode, path, 1)
                        cells.append(cell(r, one, len(mode) + 2 + len(cols)))
                    line = f"| {path:<9} | {n:>7} | " + " | ".join(cells)
                    if len(modes) == 2:
                        b, u = (self.row(net, mode, path, n) for mode in modes)
                        ratio = "-"
                        if b is not None and u is not None and measured(b) and measured(u):
                            ratio = f"{b['tokens_per_s'] / u['tokens_per_s']:.2f}x"
                        line += f" | {ratio:>9}"
                    print(line + " |")
            for mode in modes:
                for text in self.targets(net, mode) or [f"[{net} {mode}] targets need the 1- and {MANY}-stream rows"]:
                    print(text)
        for r in self.rows:
            if not measured(r):
                print(f"failed: {r['net']}/{r['mode']}/{r['path']} x{r['streams']}: {'; '.join(r['errors'])}")
        short = [r for r in self.rows if measured(r) and r["fewest_tokens"] < self.args.tokens]
        for r in short:
            print(
                f"note: {r['net']}/{r['mode']}/{r['path']} x{r['streams']}: a stream ended after {r['fewest_tokens']} "
                f"of {self.args.tokens} tokens (EOS): its rows weigh fewer tokens"
            )

    def targets(self, net: str, mode: str) -> list[str]:
        """Issue 29's targets as PASS/FAIL lines, where the rows they compare were measured."""
        out = []
        for path in ("api", "processes"):
            many, one = self.row(net, mode, path, MANY), self.row(net, mode, path, 1)
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
                out.append(f"{verdict(t <= 2.0)} {tag} p50 time between tokens {t:.2f}x one stream's (<= 2x)")
                out.append(f"{verdict(many['jain'] >= 0.95)} {tag} Jain's index {many['jain']:.3f} (>= 0.95)")
        return out


def net_name(net: str) -> str:
    if net == "loopback":
        return "loopback (127.0.0.1, no WAN)"
    return f"WAN: 3 hops, {WAN_DELAY_MS:.0f} ms one way between any two nodes, {WAN_MBIT:.0f} Mbit/s per node"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        spec = json.loads(argv[1])
        api_worker(spec) if spec["kind"] == "api" else client_worker(spec)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="loopback, 1 and 4 streams and processes, 12 tokens")
    p.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 32], help="concurrent API streams per row")
    p.add_argument("--processes", type=int, nargs="*", default=[1, 16], help="client processes generating at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every server and the API")
    p.add_argument("--tokens", type=int, default=32, help="tokens each stream generates")
    p.add_argument("--one-repeats", type=int, default=3, help="one-stream rounds, the median kept (the baseline)")
    p.add_argument("--nets", nargs="+", choices=["loopback", "wan"], default=["loopback", "wan"])
    p.add_argument("--paths", nargs="+", choices=["api", "processes"], default=["api", "processes"])
    p.add_argument("--modes", nargs="+", choices=["batched", "unbatched"], default=["batched", "unbatched"])
    p.add_argument("--batched-args", default="", help="extra server flags of the batched rows (default: none)")
    p.add_argument("--unbatched-args", default="--max-batch 1", help="extra server flags of the unbatched rows")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a worker may go without a result")
    p.add_argument("--json", type=Path, default=None, help="also write every row here (after each one)")
    p.add_argument("--report", type=Path, default=None, help="print the tables of a run saved with --json; run none")
    args = p.parse_args(argv)
    if args.report:
        Bench.saved(args.report).report()
        return 0
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.quick:
        args.streams, args.processes, args.tokens, args.nets = [1, 4], [1, 4], 12, ["loopback"]
    known = server_flags()
    check_flags("--batched-args", shlex.split(args.batched_args), known)
    check_flags("--unbatched-args", shlex.split(args.unbatched_args), known)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every server, API and client is stopped
    bench = Bench(args)
    t0 = time.perf_counter()
    try:
        bench.run()
    finally:
        bench.machine["load_end"] = os.getloadavg()
        bench.report()
        if args.json:
            bench.save()
        print(f"\nwall time {time.perf_counter() - t0:.0f} s; logs in {bench.tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
