"""A server that lies about its load, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT
peer, record, blocks and transports) whose signed record announces ``SESSIONS`` open inference sessions whatever it
really holds; everything else it does is honest.

    python -m tests.helpers.load_liar SESSIONS [swarm.serve arguments...]

``start_load_liar`` starts one in a ``LocalSwarm``, which stops it with its own peers."""

from __future__ import annotations

import sys

from swarm.launch import LocalSwarm, PeerProcess
from tests.helpers.wrapped import start_wrapped


def install(sessions: int) -> None:
    """Every record this process's peer announces claims ``sessions`` open sessions."""
    from peers.node import Peer
    from swarm.ids import Span
    from swarm.records import PeerState, ServerRecord

    honest = Peer._server_record

    def lying_record(self: Peer, span: Span, state: PeerState) -> ServerRecord:
        return honest(self, span, state).model_copy(update={"open_sessions": sessions})

    Peer._server_record = lying_record  # type: ignore[method-assign]


def start_load_liar(swarm: LocalSwarm, sessions: int, span: str, wait: bool = True) -> PeerProcess:
    """A server of ``span`` in ``swarm`` announcing ``sessions`` open sessions, started as ``LocalSwarm`` starts its
    peers (and stopped with them)."""
    return start_wrapped(swarm, "tests.helpers.load_liar", [str(sessions)], span, f"load-liar-{sessions}", [], wait)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.helpers.load_liar SESSIONS [swarm.serve arguments...]")
        return 2
    install(int(argv[0]))
    from swarm.serve import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
