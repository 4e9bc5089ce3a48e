"""``python -m swarm.status``: the swarm as a user wants to see it: who serves which blocks, in what state, how fast,
with how much cache room and how many requests served, and whether each model is fully covered."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from swarm.client.loop import LoopThread
from swarm.client.remote import Remote
from swarm.client.routing import Hop, servers
from swarm.config import Timing
from swarm.dht import read_all, read_view, start_dht
from swarm.errors import SwarmError
from swarm.ids import broker_key
from swarm.lease import Lease, winner
from swarm.records import PeerState, ServerRecord


def coverage(view: Mapping[int, list[ServerRecord]], num_blocks: int) -> list[tuple[int, int, int]]:
    """Runs of blocks with the same number of online servers: (start, end, count)."""
    runs: list[tuple[int, int, int]] = []
    for b in range(num_blocks):
        n = len({r.peer_id for r in view.get(b, []) if r.state == PeerState.ONLINE})
        if runs and runs[-1][2] == n and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1, n)
        else:
            runs.append((b, b + 1, n))
    return runs


def render(
    model_id: str, view: Mapping[int, list[ServerRecord]], live: Mapping[str, dict], broker: dict | None = None
) -> str:
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
        f"{'requests':>9}  {'dtype':<8} device"
    )
    lines += ["", header, "-" * len(header)]
    for r in recs:
        stats = live.get(r.peer_id, {})
        served = sum(stats.get("stats", {}).values()) if stats else r.requests_served
        cache = f"{stats.get('cache_tokens_free', r.cache_tokens_free)}/{r.cache_tokens_total}"
        lines.append(
            f"{'..' + r.peer_id[-12:]:<14} {r.state.value:<8} {f'{r.start}:{r.end}':<8} {r.forward_tps:>10.1f} "
            f"{r.inference_sps:>10.1f} {cache:>11} {served:>9}  {r.dtype:<8} {r.device}"
        )
    lines += ["", "coverage: " + ", ".join(f"{a}:{b} x{n}" for a, b, n in runs)]
    if broker:
        lines.append(f"broker: ..{broker.holder[-12:]} (term {broker.term})")
    return "\n".join(lines)


def current_broker(values: list, now: float) -> Lease | None:
    leases = [Lease(v["term"], v["holder"], v["expires"]) for v in values if isinstance(v, dict) and "term" in v]
    return winner(leases, now)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.status", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    p.add_argument("--model", default="smollm2-135m", help="model id as announced (default smollm2-135m)")
    p.add_argument("--max-blocks", type=int, default=128, help="how many block keys to look up")
    args = p.parse_args(argv)
    timing = Timing()
    dht, _ = start_dht(initial_peers=tuple(args.initial_peers), client_mode=True)
    loop = LoopThread()
    try:
        view = read_view(dht, args.model, args.max_blocks)
        remote = Remote(loop.run(dht.replicate_p2p()))
        live = {}
        for r in servers(view).values():
            try:
                live[r.peer_id] = loop.run(remote.info(Hop(r.peer_id, r.start, r.end, r.maddrs), timing.open_timeout))
            except SwarmError:
                pass  # the record stands in for a peer that did not answer
        from hivemind.utils import get_dht_time

        broker = current_broker(read_all(dht, broker_key(args.model)), get_dht_time())
        print(render(args.model, view, live, broker))
    finally:
        loop.close()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
