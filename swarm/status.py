"""``python -m swarm.status``: the swarm as a user wants to see it: who serves which blocks, in what state, how fast,
with how much cache room and how many requests served, on which runtime, and whether each model is fully covered.

Readable at dozens of peers: a summary line (peers by state), a per-block strip of replica counts with its minimum and
maximum, the peers joining and leaving now, then one line per peer grouped by span. A one-shot read cannot see a peer
that was killed (its records simply expire), so ``--watch SECONDS`` keeps reading and prints, between reads, who
joined, left, changed state or stopped answering (the dashboard's diff of snapshots)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from swarm.config import Timing
from swarm.dashboard.observer import BrokerView, Event, Snapshot, build_snapshot, clip, diff
from swarm.dht import RecordStore, current_broker, start_dht
from swarm.errors import SwarmError, run_command
from swarm.hop import Hop
from swarm.hub import HubName
from swarm.logs import add_log_flags, configure_logging
from swarm.membership import swarm_key_for
from swarm.protocol import InfoReply
from swarm.quantization import describe
from swarm.records import ALL_CAPABILITIES, Lease, PeerState, ServerRecord, View, servers
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote

WIDTH = 120  # no line longer: a status pasted into an issue or a terminal stays legible
STRIP = 100  # blocks per row of the replica strip
LABEL = 9  # width of the strip's row labels
ORDER = {PeerState.ONLINE: 0, PeerState.STANDBY: 1, PeerState.JOINING: 2, PeerState.LEAVING: 3}
MAX_CONCURRENT = 16  # info calls in flight at once
Live = Mapping[str, InfoReply | None]  # peer id -> its info reply; None: asked, did not answer; absent: not asked


def coverage(view: View, num_blocks: int) -> list[tuple[int, int, int]]:
    """Runs of blocks with the same number of online servers: (start, end, count)."""
    runs: list[tuple[int, int, int]] = []
    for b in range(num_blocks):
        n = len({r.peer_id for r in view.get(b, []) if r.state == PeerState.ONLINE})
        if runs and runs[-1][2] == n and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1, n)
        else:
            runs.append((b, b + 1, n))
    return runs


def short(peer_id: str) -> str:
    return ".." + clip(peer_id)[-12:]


def _reached(record: ServerRecord) -> str:
    """How the peer is reached (``swarm.relay``), ``+relay`` where it relays for others."""
    return record.reached + ("+relay" if record.relays_for_others else "")


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 1] + "\u2026"


def strip(counts: Sequence[int]) -> str:
    """One character per block: '.' none, 1-9 that many, '+' ten or more."""
    return "".join("." if n <= 0 else str(n) if n < 10 else "+" for n in counts)


def ruler(start: int, end: int) -> str:
    """Block numbers every ten blocks, each written from its own column."""
    out = [" "] * (end - start)
    for b in range(start + (-start % 10), end, 10):
        for i, c in enumerate(str(b)):
            if b - start + i < len(out):
                out[b - start + i] = c
    return "".join(out)


def _where(counts: Sequence[int], value: int) -> str:
    """The blocks holding ``value``, as runs ("3:5, 9")."""
    runs: list[list[int]] = []
    for b, n in enumerate(counts):
        if n == value:
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
    text = ", ".join(f"{a}" if b == a + 1 else f"{a}:{b}" for a, b in runs)
    return text if len(text) <= 30 else text[: text.rfind(",", 0, 29)] + ", \u2026"


def replica_lines(online: Sequence[int], standby: Sequence[int]) -> list[str]:
    """The per-block strip of online replicas (and standbys, where any), with the minimum and maximum."""
    if not online:
        return []
    low, high = min(online), max(online)
    lines = [
        _fit(
            f"online replicas per block: min {low} (block {_where(online, low)}), max {high} "
            f"(block {_where(online, high)});  . none, + ten or more"
        )
    ]
    for a in range(0, len(online), STRIP):
        b = min(a + STRIP, len(online))
        lines.append(f"{'block':<{LABEL}}{ruler(a, b)}".rstrip())
        lines.append(f"{'online':<{LABEL}}{strip(online[a:b])}")
        if any(standby):
            lines.append(f"{'standby':<{LABEL}}{strip(standby[a:b])}")
    return lines


def summary(recs: Sequence[ServerRecord], live: Live) -> str:
    states = Counter(r.state for r in recs)
    silent = sum(1 for r in recs if r.peer_id in live and live[r.peer_id] is None)
    counts = ", ".join(f"{states[s]} {s.value}" for s in ORDER)
    return f"peers: {counts}" + (f"; {silent} did not answer (*)" if silent else "")


def revisions(recs: Sequence[ServerRecord]) -> list[str]:
    """The Hub commits the peers serve, where they name one: peers of two revisions never share a chain."""
    named = Counter(r.revision[:12] for r in recs if r.revision)
    if not named:
        return []
    label = "revision" if len(named) == 1 else f"{len(named)} revisions (never in one chain)"
    return pack(f"{label}: ", [f"{rev} ({n} peers)" for rev, n in named.most_common()])


def moving(recs: Sequence[ServerRecord]) -> list[str]:
    """The peers joining or leaving right now (a killed peer's quit is seen only by ``--watch``)."""
    lines = []
    for state, label in ((PeerState.JOINING, "joining now"), (PeerState.LEAVING, "leaving now")):
        who = [f"{short(r.peer_id)} {r.start}:{r.end}" for r in recs if r.state == state]
        if who:
            lines += pack(f"{label} ({len(who)}): ", who)
    return lines


def pack(prefix: str, items: Sequence[str]) -> list[str]:
    """``prefix`` and the items, comma-separated, in lines of at most ``WIDTH`` (an item is never split)."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(line) + len(piece) + 1 > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = "  "
        line += piece if line in (prefix, "  ") else " " + piece
    return [*lines, _fit(line)]


def peer_line(r: ServerRecord, info: InfoReply | None, asked: bool) -> str:
    served = sum(info.stats.values()) if info is not None else r.requests_served
    free = info.cache_tokens_free if info is not None else r.cache_tokens_free
    cache = f"{free}/{r.cache_tokens_total}"
    state = r.state.value + ("*" if asked and info is None else "")
    weights = clip(describe(r.dtype, r.quantization), 24)
    return _fit(
        f"{short(r.peer_id):<14} {state:<8} {f'{r.start}:{r.end}':<8} {r.forward_tps:>10.1f} "
        f"{r.inference_sps:>10.1f} {cache:>11} {served:>9}  {weights:<12} {r.runtime:<8} {_reached(r):<10} "
        f"{clip(r.device)}"
    )


def render(model_id: str, view: View, live: Live, broker: Lease | None = None, dropped: int = 0) -> str:
    """The whole status of one model. ``live``: peer id -> its info reply (None: asked and silent)."""
    recs = sorted(servers(view).values(), key=lambda r: (r.start, r.end, ORDER[r.state], r.peer_id))
    if not recs:
        return f"model {clip(model_id)}: no peers found"
    num_blocks = max(r.num_blocks for r in recs)
    runs = coverage(view, num_blocks)
    missing = [f"{a}:{b}" for a, b, n in runs if n == 0]
    lines = [
        _fit(
            f"model {clip(model_id)}: {num_blocks} blocks, {len(recs)} peers, "
            + ("fully covered" if not missing else f"NOT covered: blocks {', '.join(missing)}")
        ),
        summary(recs, live),
        *revisions(recs),
        *replica_lines([n for a, b, n in runs for _ in range(a, b)], standbys(recs, num_blocks)),
        *moving(recs),
    ]
    header = (
        f"{'peer':<14} {'state':<8} {'blocks':<8} {'fwd tok/s':>10} {'inf step/s':>10} {'cache free':>11} "
        f"{'requests':>9}  {'weights':<12} {'runtime':<8} {'reached':<10} device"
    )
    lines += ["", header, "-" * len(header)]
    lines += [peer_line(r, live.get(r.peer_id), r.peer_id in live) for r in recs]
    if any(r.peer_id in live and live[r.peer_id] is None for r in recs):
        lines.append("* did not answer its info call: its figures are what its record says")
    relays = [short(r.peer_id) for r in recs if r.relays_for_others]
    if relays:
        lines += pack("relaying for peers behind NAT: ", relays)
    lines += ["", *pack("coverage: ", [f"{a}:{b} x{n}" for a, b, n in runs])]
    partial = {(r.runtime, ", ".join(sorted(r.capabilities))) for r in recs if r.capabilities != ALL_CAPABILITIES}
    lines += [
        _fit(f"runtime {name} serves only: {caps} (routes needing more skip it)") for name, caps in sorted(partial)
    ]
    if broker:
        lines.append(f"broker: {short(broker.holder)} (term {broker.term})")
    lines.append(f"records dropped (unsigned, signed by another peer, or malformed): {dropped}")
    return "\n".join(lines)


def standbys(recs: Sequence[ServerRecord], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for r in recs:
        if r.state == PeerState.STANDBY:
            for b in range(r.start, min(r.end, num_blocks)):
                counts[b] += 1
    return counts


def event_line(e: Event) -> str:
    """One change seen by ``--watch``: its time, its kind, the peer and what changed."""
    stamp = time.strftime("%H:%M:%S", time.localtime(e.at))
    who = f" {short(e.peer_id)}" if e.peer_id else ""
    return _fit(f"{stamp} {e.kind:<11}{who} {e.detail}")


def snapshot_of(model_id: str, view: View, live: Live, broker: Lease | None, dropped: int, now: float) -> Snapshot:
    """The dashboard's snapshot of what was read, so ``--watch`` reports changes exactly as the dashboard does."""
    recs = servers(view).values()
    num_blocks = max((r.num_blocks for r in recs), default=0)
    holder = None if broker is None else BrokerView(holder=clip(broker.holder, 128), term=broker.term)
    return build_snapshot(model_id, num_blocks, view, live, holder, dropped, now)


async def ask_all(remote: Remote, recs: Sequence[ServerRecord], timeout: float) -> dict[str, InfoReply | None]:
    """Every peer's live stats at once (a silent peer costs one timeout, not one per peer); leaving peers are not
    asked (they are going)."""
    gate = asyncio.Semaphore(MAX_CONCURRENT)

    async def one(r: ServerRecord) -> InfoReply | None:
        async with gate:
            try:
                reply = await asyncio.wait_for(remote.info(Hop.of(r), timeout), timeout + 1.0)
            except (SwarmError, TimeoutError, OSError):
                return None
        return reply if reply.peer_id == r.peer_id else None

    asked = [r for r in recs if r.state != PeerState.LEAVING]
    replies = await asyncio.gather(*(one(r) for r in asked))
    return dict(zip((r.peer_id for r in asked), replies, strict=True))


class Reader:
    """A DHT client and a transport, to read the swarm once or again and again (``--watch``)."""

    def __init__(self, initial_peers: tuple[str, ...], timing: Timing, swarm_key: Path | None) -> None:
        self.timing = timing
        self.store: RecordStore = start_dht(
            initial_peers=initial_peers,
            client_mode=True,
            timeout=timing.dht_start_timeout,
            call_timeout=timing.dht_timeout,
            swarm_key=swarm_key_for(swarm_key),
        )
        self.loop = LoopThread("swarm-status")
        self.remote: Remote | None = None

    def read(self, model_id: str, max_blocks: int) -> tuple[View, dict[str, InfoReply | None], Lease | None, int]:
        view = self.store.view(model_id, max_blocks)
        if self.remote is None:
            self.remote = Remote(self.loop.run(self.store.replicate_p2p()), self.store.credentials())
        live = self.loop.run(ask_all(self.remote, list(servers(view).values()), self.timing.open_timeout))
        broker = current_broker(self.store, model_id, self.timing)
        return view, live, broker, sum(self.store.dropped.values())

    def close(self) -> None:
        if self.remote is not None:  # shut the P2P replica down on its loop, so nothing is left pending at exit
            with contextlib.suppress(Exception):
                self.loop.run(self.remote.p2p.shutdown(), self.timing.shutdown_timeout)
        self.loop.close(self.timing.shutdown_timeout)
        self.store.shutdown()


def show(
    initial_peers: tuple[str, ...],
    model_id: str,
    max_blocks: int,
    timing: Timing,
    swarm_key: Path | None = None,
    watch: float | None = None,
    rounds: int | None = None,
) -> str:
    """The status; with ``watch``, printed at once and followed, every ``watch`` seconds (``rounds`` times, or until
    interrupted), by what changed since the read before."""
    reader = Reader(initial_peers, timing, swarm_key)
    try:
        view, live, broker, dropped = reader.read(model_id, max_blocks)
        text = render(model_id, view, live, broker, dropped)
        if watch is None:
            return text
        note = f"watching every {watch:g} s (Ctrl-C stops): joins, quits and changes as they are seen"
        print(text, "", note, sep="\n", flush=True)
        old = snapshot_of(model_id, view, live, broker, dropped, time.time())
        with interrupt_sets() as stop:
            done = 0
            while (rounds is None or done < rounds) and not stop.wait(watch):
                view, live, broker, dropped = reader.read(model_id, max_blocks)
                new = snapshot_of(model_id, view, live, broker, dropped, time.time())
                events = diff(old, new, new.taken_at)
                if events:
                    recs = list(servers(view).values())
                    print(*(event_line(e) for e in events), "         " + summary(recs, live), sep="\n", flush=True)
                old, done = new, done + 1
        return ""
    finally:
        reader.close()


@contextlib.contextmanager
def interrupt_sets() -> Iterator[threading.Event]:
    """An event Ctrl-C (SIGINT) sets, so ``--watch`` stops between two reads: an interrupt raised inside a DHT read
    could leave the DHT's pipe to its process half-used and its shutdown waiting."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.status", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="model id as announced: a card's name, a folder's name, or a Hub name (ORG/NAME[@REVISION]: its "
        "peers of every revision are shown, each revision named) (default smollm2-135m)",
    )
    p.add_argument("--max-blocks", type=int, default=128, help="how many block keys to look up")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    p.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="keep reading; print who joins and quits"
    )
    p.add_argument("--rounds", type=int, default=None, metavar="N", help="with --watch: stop after N more reads")
    add_log_flags(p, "WARNING")
    args = p.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.watch is not None and args.watch <= 0:
        p.error("--watch takes a positive number of seconds")

    hub = HubName.parse(args.model)
    model = hub.repo if hub is not None else args.model  # the swarm's id of a Hub model is its repository's name

    def command() -> None:
        text = show(
            tuple(args.initial_peers), model, args.max_blocks, Timing(), args.swarm_key, args.watch, args.rounds
        )
        if text:
            print(text)

    with contextlib.suppress(KeyboardInterrupt):
        return run_command(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
