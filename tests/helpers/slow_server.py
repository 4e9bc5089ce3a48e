"""A saturated server, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT peer, record, blocks
and transports) whose compute thread takes ``DELAY`` seconds longer per call, as a server whose queue is full of
other sessions' work would; its RPC loop stays free, as it is on a real saturated server whose steps batch on the
compute thread (``--inline-tokens 0``: no step runs on the loop).

    python -m tests.helpers.slow_server DELAY [swarm.serve arguments...]

``start_slow`` starts one in a ``LocalSwarm`` (announcing itself ten times faster than the honest test servers, so
clients route to it first), which stops it with its own peers."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from swarm.launch import LocalSwarm, PeerProcess
from tests.helpers.wrapped import start_wrapped


def install(delay: float) -> None:
    """Every call of this process's torch spans waits ``delay`` seconds first, on the compute thread only."""
    from peers.blocks.backend import SpanBackend

    run, run_batch = SpanBackend.run, SpanBackend.run_batch

    def stall() -> None:
        if threading.current_thread().name.startswith("compute"):  # the engine's thread; the loop stays free
            time.sleep(delay)

    def slow_run(self: SpanBackend, *args: Any, **kwargs: Any) -> Any:
        stall()
        return run(self, *args, **kwargs)

    def slow_run_batch(self: SpanBackend, *args: Any, **kwargs: Any) -> Any:
        stall()
        return run_batch(self, *args, **kwargs)

    SpanBackend.run = slow_run  # type: ignore[method-assign]
    SpanBackend.run_batch = slow_run_batch  # type: ignore[method-assign]


def start_slow(swarm: LocalSwarm, delay: float, span: str, wait: bool = True) -> PeerProcess:
    """A saturated server of ``span`` in ``swarm``, started as ``LocalSwarm`` starts its peers."""
    extra = ["--throughput", "1000", "--inline-tokens", "0"]
    return start_wrapped(swarm, "tests.helpers.slow_server", [repr(delay)], span, "slow", extra, wait)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.helpers.slow_server DELAY [swarm.serve arguments...]")
        return 2
    install(float(argv[0]))
    from swarm.serve import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
