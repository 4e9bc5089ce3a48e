"""A server no previous hop can reach, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT
peer, record, blocks and transports) that ends every push stream at once, as if the relay or link carrying pushes to
it were gone; its clients' own streams to it work.

    python -m tests.helpers.push_refuser [swarm.serve arguments...]

``start_push_refuser`` starts one in a ``LocalSwarm`` (announcing itself ten times faster than the honest test
servers, so clients route to it first), which stops it with its own peers."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from swarm.launch import LocalSwarm, PeerProcess


def install() -> None:
    """Every push stream to this process's server ends before a frame of it is read."""
    from peers.rpc.chain import StepPusher

    async def refuse(self: StepPusher, frames: Any, context: Any) -> AsyncIterator[Any]:
        nothing: tuple[Any, ...] = ()  # a stream handler is a generator: this one ends at once
        for frame in nothing:
            yield frame

    StepPusher.rpc_push = refuse  # type: ignore[method-assign]


def start_push_refuser(swarm: LocalSwarm, span: str, wait: bool = True) -> PeerProcess:
    """A server of ``span`` in ``swarm`` that no push reaches, started as ``LocalSwarm`` starts its peers."""
    cmd = [sys.executable, "-m", "tests.helpers.push_refuser", "--model", swarm.model, *swarm.extra_args]
    cmd += ["--throughput", "1000", "--initial-peers", *swarm.initial_peers, "--blocks", span]
    if swarm.test_timings:
        cmd.append("--test-timings")
    swarm.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = swarm.log_dir / f"push-refuser-{len(swarm.peers)}.log"
    with open(log_path, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=swarm.env)
    peer = PeerProcess(proc, span, ("push-refuser",), log_path)
    threading.Thread(target=peer._watch_stdout, daemon=True).start()
    swarm.peers.append(peer)
    if wait:
        peer.wait_ready(swarm.startup_timeout)
    return peer


def main(argv: list[str]) -> int:
    install()
    from swarm.serve import main as serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
