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
over the same path's one-stream row. Before any swarm starts, the ceiling: one process holding the whole model
decodes the same streams as one batch with ``--ceiling-threads`` threads (``harness.ceiling``); its table prints
first and every row gets its ratio to it (``x ceiling``). Targets (issues 29 and 60) print as PASS/FAIL lines
(``harness.serving_report``); nothing is asserted.

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

from harness.serving_load import api_worker, client_worker, machine, summarize  # noqa: E402
from harness.serving_report import MODEL, WAN_DELAY_MS, WAN_MBIT, Run, report  # noqa: E402

SPANS = {"s1": "0:10", "s2": "10:20", "s3": "20:30"}  # WAN node -> span; on loopback the same spans
PROMPT_TOKENS = 64  # at most, with the chat template: sizes the servers' KV-cache budget
WORKER = (sys.executable, str(Path(__file__).resolve()), "--worker")
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
        self.modes = {"batched": shlex.split(args.batched_args), "unbatched": shlex.split(args.unbatched_args)}
        self.out = Run(machine(ROOT), args.nets, args.tokens, args.threads, args.batched_args, args.unbatched_args)
        self.rows, self.skipped = self.out.rows, self.out.skipped

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def server_args(self) -> tuple[str, ...]:
        """Room for every stream: the API is one caller to the servers and holds all of its streams' sessions."""
        from swarm.api.conversations import Conversations

        a = self.args
        most = max([*a.streams, *a.processes, 1])
        # the API opens each session with room for its conversation to go on (``swarm.api.conversations``)
        per_stream = PROMPT_TOKENS + a.tokens + 8 + Conversations.headroom
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

    def measure_ceiling(self) -> None:
        """One process's batched decode of the same streams (``harness.ceiling``), before any swarm starts."""
        a = self.args
        counts = sorted({*a.streams, *a.processes} if "processes" in a.paths else set(a.streams))
        if not counts or a.ceiling_threads < 1:
            return
        self.log(f"the ceiling: one process, batches of {' '.join(map(str, counts))}, {a.ceiling_threads} threads")
        cmd = [sys.executable, "-m", "harness.ceiling", "--model", MODEL, "--tokens", str(a.tokens)]
        cmd += ["--threads", str(a.ceiling_threads), "--streams", *map(str, counts)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=a.timeout)
        for line in done.stdout.splitlines():
            item = json.loads(line)
            self.out.ceiling[item["streams"]] = row = summarize(item["records"])
            self.log(
                f"  batch of {item['streams']}: {row['tokens_per_s']:.1f} tokens/s, p50 {row['tbt_p50_s'] * 1e3:.0f} ms"
            )
        self.out.ceiling_threads = a.ceiling_threads

    def run(self) -> None:
        from harness.wan import Wan, WanConfig, unavailable_reason

        self.measure_ceiling()
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

    def save(self) -> None:
        a, run = self.args, self.out
        run.machine["load_end"] = os.getloadavg()
        config = dict(
            model=MODEL,
            spans=list(SPANS.values()),
            tokens=a.tokens,
            threads=a.threads,
            server_args=self.server_args(),
            modes=self.modes,
            wan=dict(delay_ms=WAN_DELAY_MS, mbit=WAN_MBIT),
            ceiling_threads=run.ceiling_threads,
        )
        ceiling = {str(n): r for n, r in run.ceiling.items()}
        data = dict(machine=run.machine, config=config, rows=run.rows, skipped=run.skipped, ceiling=ceiling)
        a.json.write_text(json.dumps(data, indent=1))


def saved(path: Path) -> Run:
    """A finished run, from its ``--json`` file."""
    data = json.loads(path.read_text())
    c = data["config"]
    nets = list(dict.fromkeys(r["net"] for r in data["rows"])) + list(data["skipped"])
    modes = [shlex.join(c["modes"][m]) for m in ("batched", "unbatched")]
    run = Run(data["machine"], nets, c["tokens"], c.get("threads", 1), *modes, data["rows"], data["skipped"])
    run.ceiling = {int(n): r for n, r in data.get("ceiling", {}).items()}
    run.ceiling_threads = c.get("ceiling_threads", 0)
    return run


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
    p.add_argument(
        "--ceiling-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the ceiling: one process decoding the streams as one batch (0: no ceiling)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a worker may go without a result")
    p.add_argument("--json", type=Path, default=None, help="also write every row here (after each one)")
    p.add_argument("--report", type=Path, default=None, help="print the tables of a run saved with --json; run none")
    args = p.parse_args(argv)
    if args.report:
        report(saved(args.report))
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
        bench.out.machine["load_end"] = os.getloadavg()
        report(bench.out)
        if args.json:
            bench.save()
        print(f"\nwall time {time.perf_counter() - t0:.0f} s; logs in {bench.tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
