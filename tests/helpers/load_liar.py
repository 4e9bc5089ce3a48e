"""A server that lies about its load, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT
peer, record, blocks and transports) whose signed record announces ``SESSIONS`` open inference sessions whatever it
really holds; everything else it does is honest.

    python -m tests.helpers.load_liar SESSIONS [swarm.serve arguments...]

``start_load_liar`` starts one in a ``LocalSwarm``, which stops it with its own peers."""

from __future__ import annotations

import subprocess
import sys
import threading

from swarm.launch import LocalSwarm, PeerProcess


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
    cmd = [sys.executable, "-m", "tests.helpers.load_liar", str(sessions), "--model", swarm.model, *swarm.extra_args]
    cmd += ["--initial-peers", *swarm.initial_peers, "--blocks", span]
    if swarm.test_timings:
        cmd.append("--test-timings")
    swarm.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = swarm.log_dir / f"load-liar-{len(swarm.peers)}-{sessions}.log"
    with open(log_path, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=swarm.env)
    peer = PeerProcess(proc, span, ("load-liar",), log_path)
    threading.Thread(target=peer._watch_stdout, daemon=True).start()
    swarm.peers.append(peer)
    if wait:
        peer.wait_ready(swarm.startup_timeout)
    return peer


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.helpers.load_liar SESSIONS [swarm.serve arguments...]")
        return 2
    install(int(argv[0]))
    from swarm.serve import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
