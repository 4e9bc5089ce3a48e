"""Start a wrapped server (a module that patches something, then runs ``swarm.serve``) into a ``LocalSwarm``, as the
swarm starts its own peers: the swarm's model, arguments, initial peers and timings, a log file in its log folder,
and stopped with it. The liars, slow and push-refusing servers of the tests start this way."""

from __future__ import annotations

import subprocess
import sys
import threading

from swarm.launch import LocalSwarm, PeerProcess


def start_wrapped(
    swarm: LocalSwarm, module: str, head: list[str], span: str, label: str, extra: list[str], wait: bool = True
) -> PeerProcess:
    """``python -m module *head --model ... *extra --blocks span`` in ``swarm``; ``label`` names its log."""
    cmd = [sys.executable, "-m", module, *head, "--model", swarm.model, *swarm.extra_args, *extra]
    cmd += ["--initial-peers", *swarm.initial_peers, "--blocks", span]
    if swarm.test_timings:
        cmd.append("--test-timings")
    swarm.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = swarm.log_dir / f"{label}-{len(swarm.peers)}.log"
    with open(log_path, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=swarm.env)
    peer = PeerProcess(proc, span, (label,), log_path)
    threading.Thread(target=peer._watch_stdout, daemon=True).start()
    swarm.peers.append(peer)
    if wait:
        peer.wait_ready(swarm.startup_timeout)
    return peer
