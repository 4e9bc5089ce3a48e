"""Time from a serving peer's crash to restored coverage, with a warm standby vs without, on loopback.

    python scripts/bench_churn.py [--model smollm2-135m] [--max-blocks 10] [--peers 4]

Peers start without --blocks (the broker places them) with test timings: heartbeats every 1.5 s, a peer counted dead
after 3 s without one, the broker and followers acting every 0.5 s. With a standby pool one peer preloads the most
fragile span; without, the broker must have some peer load the lost blocks. The SIGKILLed peer is one whose blocks
no other peer serves. Prints, for each case: detection (crash -> broker replans, the same in both), reaction
(replan -> the span is served again) and the total.
"""

from __future__ import annotations

import argparse
import time

from swarm.config import Timing
from swarm.dht import start_dht
from swarm.launch import LocalSwarm
from swarm.records import PeerState, View, servers

HEARTBEAT_TIMEOUT = Timing.for_tests().heartbeat_timeout


def covered(view: View, num_blocks: int) -> bool:
    return all(any(r.state == PeerState.ONLINE for r in view[b]) for b in range(num_blocks))


def sole_server(view: View, num_blocks: int) -> str | None:
    for b in range(num_blocks):
        online = [r.peer_id for r in view[b] if r.state == PeerState.ONLINE]
        if len(online) == 1:
            return online[0]
    return None


def run_case(model: str, peers: int, max_blocks: int, standby_fraction: float, num_blocks: int) -> tuple[float, bool]:
    args = ("--throughput", "100", "--max-blocks", str(max_blocks), "--standby-fraction", str(standby_fraction))
    with LocalSwarm(model, [None] * peers, extra_args=args, test_timings=True) as swarm:
        store = start_dht(initial_peers=tuple(swarm.initial_peers), client_mode=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                view = store.view(model, num_blocks)
                has_standby = any(r.state == PeerState.STANDBY for r in servers(view).values())
                if (
                    covered(view, num_blocks)
                    and (has_standby or standby_fraction == 0)
                    and sole_server(view, num_blocks)
                ):
                    break
                time.sleep(0.5)
            victim = sole_server(view, num_blocks)
            time.sleep(2.0)  # settle
            t0 = time.monotonic()
            swarm.kill(swarm.peer_by_id(victim))
            while True:
                view = store.view(model, num_blocks)
                online = [r for r in servers(view).values() if r.peer_id != victim]
                restored = all(
                    any(r.state == PeerState.ONLINE and b in r.span for r in online) for b in range(num_blocks)
                )
                if restored:
                    return time.monotonic() - t0, has_standby
                if time.monotonic() - t0 > 120:
                    raise RuntimeError("coverage not restored in 120 s")
                time.sleep(0.05)
        finally:
            store.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-blocks", type=int, default=30)
    p.add_argument("--max-blocks", type=int, default=10)
    p.add_argument("--peers", type=int, default=4)
    args = p.parse_args()
    rows = []
    for name, fraction in (("warm standby promoted", 1.0 / args.peers), ("no standby (load from disk)", 0.0)):
        total, had_standby = run_case(args.model, args.peers, args.max_blocks, fraction, args.num_blocks)
        rows.append((name, total, had_standby))
    print(
        f"\n{args.model}: {args.peers} peers of at most {args.max_blocks} blocks; a peer is counted dead after "
        f"{HEARTBEAT_TIMEOUT:.0f} s without a heartbeat"
    )
    for name, total, had_standby in rows:
        reaction = total - HEARTBEAT_TIMEOUT
        print(
            f"  {name:<30} crash -> coverage {total:5.2f} s (after detection: {reaction:5.2f} s)"
            + ("" if had_standby or "no standby" in name else "  [no standby was formed]")
        )
    ratio = (rows[1][1] - HEARTBEAT_TIMEOUT) / max(rows[0][1] - HEARTBEAT_TIMEOUT, 1e-3)
    print(f"  standby promotion reacts {ratio:.1f}x faster once the crash is noticed")


if __name__ == "__main__":
    main()
