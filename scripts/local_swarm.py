"""Start a local swarm on 127.0.0.1 and keep it running until Ctrl-C.

    python scripts/local_swarm.py --model smollm2-135m --spans 0:10 10:20 20:30
    python scripts/local_swarm.py --model smollm2-135m --peers 4 --max-blocks 10   # the broker places them
    python scripts/local_swarm.py --spans 0:15 15:30 --api-port 8000   # + the OpenAI API and dashboard (swarm.api)

Prints the initial peers to pass to clients (`DistributedModelForCausalLM.from_pretrained(..., initial_peers=...)`)
or to `python -m swarm.status --initial-peers ...`; Ctrl-C stops every peer it started (by PID).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading

from harness.local_swarm import ApiProcess
from swarm.launch import LocalSwarm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spans", nargs="*", default=[], help="one pinned peer per span (START:END)")
    p.add_argument("--peers", type=int, default=0, help="peers without --blocks, placed by the broker")
    p.add_argument("--max-blocks", type=int, help="for broker-placed peers: most blocks each holds")
    p.add_argument("--test-timings", action="store_true", help="short TTLs and timeouts")
    p.add_argument("--api-port", type=int, help="also serve the OpenAI-compatible API and dashboard on this port")
    args, extra = p.parse_known_args()
    spans = list(args.spans) + [None] * args.peers
    if not spans:
        p.error("give --spans and/or --peers")
    if args.max_blocks:
        extra += ["--max-blocks", str(args.max_blocks)]
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalSwarm(args.model, spans, extra_args=tuple(extra), test_timings=args.test_timings) as swarm:
        print("initial peers:", " ".join(swarm.initial_peers), flush=True)
        print(f"peer logs in {swarm.log_dir}; Ctrl-C to stop", flush=True)
        with contextlib.ExitStack() as api:
            if args.api_port is not None:
                served = api.enter_context(
                    ApiProcess(
                        swarm.initial_peers,
                        "--model",
                        args.model,
                        "--port",
                        str(args.api_port),
                        test_timings=args.test_timings,
                    )
                )
                print(f"API and dashboard: {served.url} (log: {served.log_path})", flush=True)
            stop.wait()
    print("stopped.")


if __name__ == "__main__":
    main()
