"""A live swarm of N real peers on this machine, with churn: what dozens of volunteers that join and quit cost.

    python scripts/bench_scale.py --peers 8 16 --minutes 3            # the tests' short timings
    python scripts/bench_scale.py --peers 50 --minutes 15 --timings default --json scale.json

A random Llama of 48 blocks (hidden 64: about 8 MB, perturbed weights) is served by N peers forked from one fork
server (``harness.fork_server``), started without ``--blocks``: the broker places them, each holding at most
``ceil(2 x 48 / N)`` blocks, so every block has about two replicas. 8 clients (each its own DHT peer and transport)
generate without pause, greedy, with exact activations (``codec="none"``, as the tests), prompts drawn in turn from
a fixed set whose local Hugging Face answers are known, and one fine-tunes a LoRA adapter. Each minute a tenth of the
peers leave (half SIGKILL, a quarter SIGSTOP, a quarter SIGINT, as a volunteer's Ctrl-C) and as many new ones join.

Reported per N: answers, answers equal to Hugging Face (all must be), failed answers (none may be), time per token
p50/p99 and the longest stall, time from a peer's quit to its blocks served again by live peers (p50/p99, from a watcher
reading the DHT every 0.5 s), the broker's plan changes and the peers each moved (placed elsewhere, of those in both
plans), the broker's round replayed by the watcher on each new plan (the same heartbeat read and planner, timed; bytes:
the records' JSON, without each one's signature and key), fine-tuning steps, memory (proportional set size of a peer's
processes: peer, DHT, p2pd) and idle CPU per peer (before the clients start), and I/O bytes of the peers' p2pd daemons
per peer per minute (read from /proc: what the daemons wrote and read, sockets to the network and to their peer alike;
an upper bound on DHT and data traffic)."""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.procstats import cpu_seconds, p2pd_io, pss, tree
from swarm.config import Timing
from swarm.launch import LocalSwarm, PeerProcess

BLOCKS = 48
PROMPTS = 12
NEW_TOKENS = 16
CLIENTS = 8


def make_model(folder: Path, seed: int = 0) -> Path:
    """A random Llama of ``BLOCKS`` blocks, every weight perturbed (no all-ones norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return folder


def references(folder: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The prompts, and what local Hugging Face answers to each (greedy)."""
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (1, 8), generator=gen) for _ in range(PROMPTS)]
    with torch.no_grad():
        refs = [local.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0) for p in prompts]
    return prompts, refs


@dataclass
class Stats:
    answers: int = 0
    exact: int = 0
    failed: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)  # answers that differ from Hugging Face's: where and how
    gaps: list[float] = field(default_factory=list)  # seconds between tokens (the first: the prompt's)
    tune_steps: int = 0
    tune_failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Stamps:
    """A streamer that timestamps every token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: object) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def client_loop(index: int, folder: Path, peers: list[str], timing: Timing, work: tuple, stop, stats: Stats) -> None:
    from swarm import DistributedModelForCausalLM

    prompts, refs = work
    try:
        # exact activations (as the tests': "auto" may compress where a loaded machine's link probe came out slow, and
        # a lossy codec's rounding can flip a greedy token of a random model) and the default verification
        model = DistributedModelForCausalLM.from_pretrained(
            str(folder), initial_peers=peers, timing=timing, codec="none"
        )
    except Exception as e:  # noqa: BLE001 - a client that cannot connect is a failure to report, not a crash
        with stats.lock:
            stats.failed.append(f"client {index} could not connect: {e!r}")
        return
    with model:
        k = index
        while not stop.is_set():
            p = k % len(prompts)
            k += 1
            stamps = Stamps()
            try:
                out = model.generate(prompts[p], max_new_tokens=NEW_TOKENS, do_sample=False, streamer=stamps)
            except Exception as e:  # noqa: BLE001 - counted: every failed answer is reported
                with stats.lock:
                    if not stats.failed or type(e).__name__ not in stats.failed[-1]:
                        print(f"client {index}: {e!r}"[:400], file=sys.stderr, flush=True)  # a new kind, at once
                    stats.failed.append(repr(e)[:300])
                continue
            with stats.lock:
                stats.answers += 1
                same = out.shape == refs[p].shape and bool(torch.equal(out, refs[p]))
                stats.exact += same
                if not same:
                    n = prompts[p].shape[1]
                    got, want = out[0, n:].tolist(), refs[p][0, n:].tolist()
                    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
                    detail = (
                        f"client {index}, prompt {p}: token {at} of {len(want)} differs (failovers {model.failovers})"
                    )
                    stats.inexact.append(detail)
                    print(f"inexact answer: {detail}", file=sys.stderr, flush=True)
                stats.gaps += [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]


def tuner_loop(folder: Path, peers: list[str], timing: Timing, stop, stats: Stats) -> None:
    from swarm import DistributedModelForCausalLM

    try:
        model = DistributedModelForCausalLM.from_pretrained(
            str(folder), initial_peers=peers, timing=timing, tuning="lora", lora_rank=4
        )
    except Exception as e:  # noqa: BLE001
        stats.tune_failed.append(f"could not connect: {e!r}")
        print(f"fine-tuner: could not connect: {e!r}"[:400], file=sys.stderr, flush=True)
        return
    with model:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(2))
        while not stop.is_set():
            try:
                loss = model(ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            except Exception as e:  # noqa: BLE001
                if not stats.tune_failed or type(e).__name__ not in stats.tune_failed[-1]:
                    print(f"fine-tuner: {e!r}"[:400], file=sys.stderr, flush=True)  # a new kind, at once
                stats.tune_failed.append(repr(e)[:300])
                continue
            if not math.isfinite(loss.item()):
                stats.tune_failed.append(f"loss {loss.item()}")
            stats.tune_steps += 1


class Watcher:
    """Reads the DHT every 0.5 s: for each quit, when every block the peer served has a live server again."""

    def __init__(self, peers: list[str], model: str, timing: Timing) -> None:
        from swarm.dht import start_dht

        self.store = start_dht(initial_peers=tuple(peers), client_mode=True)
        self.model, self.timing = model, timing
        self.gone: set[str] = set()
        self.pending: list[tuple[str, float, range]] = []  # peer, when it quit, its blocks
        self.restored: list[float] = []
        self.lock = threading.Lock()
        self.plan: dict[str, tuple[int, int, str]] | None = None  # the broker's latest placements seen
        self.plan_stamp: tuple[int, float] | None = None  # (term, issued_at) of that plan
        self.moves: list[int] = []  # per change of plan: peers in both plans whose placement changed
        self.rounds: list[tuple[float, int]] = []  # the broker's round replayed: seconds (read + plan), bytes read
        self.view: dict | None = None  # the latest read

    def span_of(self, peer_id: str) -> range:
        """From the latest view the watcher read (a read of its own could time out on a machine this loaded)."""
        from swarm.records import servers

        with self.lock:
            view = self.view
        record = servers(view).get(peer_id) if view is not None else None
        return range(record.start, record.end) if record is not None else range(0)

    def quit(self, peer_id: str, span: range) -> None:
        with self.lock:
            self.gone.add(peer_id)
            self.pending.append((peer_id, time.monotonic(), span))

    def run(self, stop) -> None:
        from swarm.records import PeerState

        while not stop.is_set():
            try:
                view = self.store.view(self.model, BLOCKS)
            except Exception:  # noqa: BLE001 - a slow read is retried
                continue
            self.follow_broker()
            now = time.monotonic()
            with self.lock:
                self.view = view
                live = {b: {r.peer_id for r in view[b] if r.state == PeerState.ONLINE} - self.gone for b in view}
                still = []
                for peer, t0, span in self.pending:
                    if all(live.get(b) for b in span):
                        self.restored.append(now - t0)
                    else:
                        still.append((peer, t0, span))
                self.pending = still
            stop.wait(0.5)

    def follow_broker(self) -> None:
        """On each new plan of the broker, the peers it moved, and its round replayed here: the same read of the
        peers' heartbeats and the same planner the broker runs (``peers.broker``), timed."""
        from peers.broker.loop import live_peers
        from peers.broker.planner import Policy, plan_swarm
        from swarm.dht import dht_time
        from swarm.ids import assignment_key
        from swarm.records import Assignment

        try:
            plans = self.store.read(assignment_key(self.model), Assignment)
        except Exception:  # noqa: BLE001 - a slow read is retried on the next turn
            return
        if not plans:
            return
        plan = max(plans, key=lambda a: (a.term, a.issued_at))
        if (plan.term, plan.issued_at) == self.plan_stamp:
            return
        self.plan_stamp = (plan.term, plan.issued_at)
        placed = {pid: (pl.start, pl.end, pl.role) for pid, pl in plan.placements.items()}
        if self.plan is not None and placed != self.plan:
            self.moves.append(sum(1 for pid, pl in placed.items() if pid in self.plan and self.plan[pid] != pl))
        self.plan = placed
        t0 = time.perf_counter()
        records = self.store.heartbeats(self.model)
        peers = live_peers(records, dht_time(), self.timing.heartbeat_timeout, self.timing.clock_skew)
        plan_swarm(peers, BLOCKS, max((r.block_bytes for r in records), default=1) or 1, Policy())
        read_bytes = sum(len(json.dumps(r.to_wire())) for r in records)
        self.rounds.append((time.perf_counter() - t0, read_bytes))

    def close(self) -> None:
        self.store.shutdown()


def churn(swarm: LocalSwarm, live: list[PeerProcess], watcher: Watcher, rng: random.Random) -> list[str]:
    """A tenth of the live peers leave (half SIGKILL, a quarter SIGSTOP, a quarter SIGINT); as many join."""
    n = max(1, round(len(live) / 10))
    ready = [p for p in live[1:] if p.maddr]  # the first peer is everyone's bootstrap: it stays
    leaving = rng.sample(ready, min(n, len(ready)))
    events = []
    for i, peer in enumerate(leaving):
        sig = [signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP, signal.SIGINT][i % 4]
        watcher.quit(peer.peer_id, watcher.span_of(peer.peer_id))
        swarm.kill(peer, sig)
        live.remove(peer)
        events.append(f"{signal.Signals(sig).name} {peer.peer_id[-6:]}")
    for _ in leaving:
        live.append(swarm.add_peer(None, wait=False))
    return events


def run(n: int, minutes: float, timings: str, root: Path) -> dict[str, object]:
    from harness.fork_server import ForkServer

    folder = make_model(root / "llama48") if not (root / "llama48").exists() else root / "llama48"
    work = references(folder)
    timing = Timing.for_tests() if timings == "tests" else Timing()
    max_blocks = math.ceil(2 * BLOCKS / n)
    args = ("--throughput", "100", "--max-blocks", str(max_blocks))
    fork = ForkServer()
    stats, stop = Stats(), threading.Event()
    try:
        with LocalSwarm(
            str(folder), [None] * n, extra_args=args, test_timings=timings == "tests", spawner=fork
        ) as swarm:
            live = list(swarm.peers)

            def pids() -> list[int]:  # re-read: peers come and go
                return [q for p in live for q in tree(p.pid)]

            cpu0, t0 = cpu_seconds(pids()), time.monotonic()
            time.sleep(10)
            idle_cpu = (cpu_seconds(pids()) - cpu0) / (time.monotonic() - t0) / n
            memory = pss(pids()) / n
            watcher = Watcher(swarm.initial_peers, folder.name, timing)
            threads = [threading.Thread(target=watcher.run, args=(stop,), daemon=True)]
            threads += [
                threading.Thread(target=client_loop, args=(i, folder, swarm.initial_peers, timing, work, stop, stats))
                for i in range(CLIENTS)
            ]
            threads.append(threading.Thread(target=tuner_loop, args=(folder, swarm.initial_peers, timing, stop, stats)))
            for t in threads:
                t.start()
            io0, start, rng, events = p2pd_io(pids()), time.monotonic(), random.Random(n), []
            while time.monotonic() - start < minutes * 60:
                time.sleep(min(60.0, minutes * 60 - (time.monotonic() - start)))
                if time.monotonic() - start < minutes * 60 - 1:
                    events += churn(swarm, live, watcher, rng)
                with stats.lock:  # progress, for a run of many minutes
                    print(
                        f"[{n} peers, {(time.monotonic() - start) / 60:.1f} min] answers {stats.answers}, "
                        f"exact {stats.exact}, failed {len(stats.failed)}, tuning steps {stats.tune_steps}, "
                        f"quits {len(watcher.restored)} served again ({len(watcher.pending)} pending)",
                        file=sys.stderr,
                        flush=True,
                    )
            io_rate = (p2pd_io(pids()) - io0) / max(len(live), 1) / ((time.monotonic() - start) / 60)
            stop.set()
            for t in threads:
                t.join(timeout=120)
            watcher.close()
    finally:
        stop.set()
        fork.close()
    gaps = sorted(stats.gaps) or [0.0]

    def pct(q: float, xs: list[float]) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    restored = sorted(watcher.restored)
    return dict(
        peers=n,
        minutes=minutes,
        timings=timings,
        answers=stats.answers,
        exact=stats.exact,
        failed=len(stats.failed),
        failures=stats.failed[:5],
        inexact=stats.inexact[:5],
        tune_failures=stats.tune_failed[:3],
        token_p50_ms=1000 * statistics.median(gaps),
        token_p99_ms=1000 * pct(0.99, gaps),
        longest_stall_s=gaps[-1],
        restored_p50_s=statistics.median(restored) if restored else None,
        restored_p99_s=pct(0.99, restored) if restored else None,
        quits=len(watcher.restored) + len(watcher.pending),
        never_restored=len(watcher.pending),
        broker_round_p50_ms=1000 * statistics.median(r[0] for r in watcher.rounds) if watcher.rounds else None,
        broker_round_read_kb=max((r[1] for r in watcher.rounds), default=0) / 1024,
        plan_changes=len(watcher.moves),
        moved_per_change=statistics.mean(watcher.moves) if watcher.moves else 0.0,
        tune_steps=stats.tune_steps,
        tune_failed=len(stats.tune_failed),
        pss_per_peer_mb=memory / 2**20,
        idle_cpu_per_peer=idle_cpu,
        p2pd_io_per_peer_per_min_kb=io_rate / 1024,
        events=events,
    )


def _s(seconds: object) -> str:
    return f"{seconds:.1f}" if isinstance(seconds, float) else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 50])
    p.add_argument("--minutes", type=float, default=15.0, help="of churn and generation, per N")
    p.add_argument("--timings", choices=["tests", "default"], default="tests")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n in args.peers:
            row = run(n, args.minutes, args.timings, Path(tmp))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "events"}), flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(rows, indent=1))
    print(
        "\n| N | answers | equal to HF | failed | token p50 / p99 ms | longest stall s | served again p50 / p99 s "
        "| broker round ms | moved per change |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['peers']} | {r['answers']} | {r['exact']} | {r['failed']} | {r['token_p50_ms']:.0f} / "
            f"{r['token_p99_ms']:.0f} | {r['longest_stall_s']:.1f} | "
            f"{_s(r['restored_p50_s'])} / {_s(r['restored_p99_s'])} | {_s(r['broker_round_p50_ms'])} | "
            f"{r['moved_per_change']:.1f} |"
        )


if __name__ == "__main__":
    main()
