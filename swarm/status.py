"""``python -m swarm.status``: the swarm as a user wants to see it: who serves which blocks, in what state, how fast,
with how much cache room and how many requests served, on which runtime, and whether each model is fully covered."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from swarm.config import Timing
from swarm.dht import current_broker, start_dht
from swarm.errors import SwarmError, run_command
from swarm.hop import Hop
from swarm.logs import add_log_flags, configure_logging
from swarm.membership import swarm_key_for
from swarm.protocol import InfoReply
from swarm.quantization import describe
from swarm.records import ALL_CAPABILITIES, Lease, PeerState, ServerRecord, View, servers
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote


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


def _reached(record: ServerRecord) -> str:
    """How the peer is reached (``swarm.relay``), ``+relay`` where it relays for others."""
    return record.reached + ("+relay" if record.relays_for_others else "")


def render(model_id: str, view: View, live: dict[str, InfoReply], broker: Lease | None = None, dropped: int = 0) -> str:
    recs = sorted(servers(view).values(), key=lambda r: (r.start, r.end, r.peer_id))
    if not recs:
        return f"model {model_id}: no peers found"
    num_blocks = max(r.num_blocks for r in recs)
    runs = coverage(view, num_blocks)
    missing = [f"{a}:{b}" for a, b, n in runs if n == 0]
    lines = [
        f"model {model_id}: {num_blocks} blocks, {len(recs)} peers, "
        + ("fully covered" if not missing else f"NOT covered: blocks {', '.join(missing)}")
    ]
    header = (
        f"{'peer':<14} {'state':<8} {'blocks':<8} {'fwd tok/s':>10} {'inf step/s':>10} {'cache free':>11} "
        f"{'requests':>9}  {'weights':<12} {'runtime':<8} {'reached':<10} device"
    )
    lines += ["", header, "-" * len(header)]
    for r in recs:
        info = live.get(r.peer_id)
        served = sum(info.stats.values()) if info is not None else r.requests_served
        free = info.cache_tokens_free if info is not None else r.cache_tokens_free
        cache = f"{free}/{r.cache_tokens_total}"
        weights = describe(r.dtype, r.quantization)
        lines.append(
            f"{'..' + r.peer_id[-12:]:<14} {r.state.value:<8} {f'{r.start}:{r.end}':<8} {r.forward_tps:>10.1f} "
            f"{r.inference_sps:>10.1f} {cache:>11} {served:>9}  {weights:<12} {r.runtime:<8} {_reached(r):<10} "
            f"{r.device}"
        )
    relays = [r for r in recs if r.relays_for_others]
    if relays:
        lines.append(f"relaying for peers behind NAT: {', '.join('..' + r.peer_id[-12:] for r in relays)}")
    lines += ["", "coverage: " + ", ".join(f"{a}:{b} x{n}" for a, b, n in runs)]
    partial = {(r.runtime, ", ".join(sorted(r.capabilities))) for r in recs if r.capabilities != ALL_CAPABILITIES}
    lines += [f"runtime {name} serves only: {caps} (routes needing more skip it)" for name, caps in sorted(partial)]
    if broker:
        lines.append(f"broker: ..{broker.holder[-12:]} (term {broker.term})")
    lines.append(f"records dropped (unsigned, signed by another peer, or malformed): {dropped}")
    return "\n".join(lines)


def show(
    initial_peers: tuple[str, ...], model_id: str, max_blocks: int, timing: Timing, swarm_key: Path | None = None
) -> str:
    store = start_dht(
        initial_peers=initial_peers,
        client_mode=True,
        timeout=timing.dht_start_timeout,
        call_timeout=timing.dht_timeout,
        swarm_key=swarm_key_for(swarm_key),
    )
    loop = LoopThread("swarm-status")
    remote: Remote | None = None
    try:
        view = store.view(model_id, max_blocks)
        remote = Remote(loop.run(store.replicate_p2p()), store.credentials())
        live: dict[str, InfoReply] = {}
        for r in servers(view).values():
            try:
                live[r.peer_id] = loop.run(remote.info(Hop.of(r), timing.open_timeout))
            except SwarmError:
                pass  # the record stands in for a peer that did not answer
        broker = current_broker(store, model_id, timing)
        return render(model_id, view, live, broker, sum(store.dropped.values()))
    finally:
        if remote is not None:  # shut the P2P replica down on its loop, so nothing is left pending at exit
            with contextlib.suppress(Exception):
                loop.run(remote.p2p.shutdown(), timing.shutdown_timeout)
        loop.close(timing.shutdown_timeout)
        store.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.status", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    p.add_argument("--model", default="smollm2-135m", help="model id as announced (default smollm2-135m)")
    p.add_argument("--max-blocks", type=int, default=128, help="how many block keys to look up")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    add_log_flags(p, "WARNING")
    args = p.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return run_command(
        lambda: print(show(tuple(args.initial_peers), args.model, args.max_blocks, Timing(), args.swarm_key))
    )


if __name__ == "__main__":
    sys.exit(main())
