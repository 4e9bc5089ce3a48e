"""A server slow only to take in a history: a real ``swarm.serve`` peer whose compute thread waits ``DELAY`` seconds
before every call that starts a session's cache (``past == 0`` with more than one position: a prompt's prefill, or a
replacement hop's replay of the history), and runs decode steps at full speed. Made the replacement of a killed hop,
it makes the client's repair outlast the servers' idle limit while every later step stays short.

    python -m tests.helpers.slow_replay DELAY [swarm.serve arguments...]"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from swarm.launch import LocalSwarm, PeerProcess
from tests.helpers.wrapped import start_wrapped


def install(delay: float) -> None:
    from peers.blocks.backend import SpanBackend

    run = SpanBackend.run

    def slow_run(self: SpanBackend, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        starting = kwargs.get("past", 0) == 0 and hidden.shape[1] > 1
        if starting and threading.current_thread().name.startswith("compute"):
            time.sleep(delay)
        return run(self, hidden, *args, **kwargs)

    SpanBackend.run = slow_run  # type: ignore[method-assign]


def start_slow_replay(swarm: LocalSwarm, delay: float, span: str) -> PeerProcess:
    """One in ``swarm``, announcing itself 100 times slower than the test servers (routes go elsewhere while they
    can); ``--inline-tokens 0``: its steps run on the compute thread, the RPC loop stays free."""
    extra = ["--throughput", "1", "--inline-tokens", "0"]
    return start_wrapped(swarm, "tests.helpers.slow_replay", [repr(delay)], span, "slow-replay", extra)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.helpers.slow_replay DELAY [swarm.serve arguments...]")
        return 2
    install(float(argv[0]))
    from swarm.serve import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
