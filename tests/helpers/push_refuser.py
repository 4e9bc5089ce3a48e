"""A server no previous hop can reach, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT
peer, record, blocks and transports) that ends every push stream at once, as if the relay or link carrying pushes to
it were gone; its clients' own streams to it work.

    python -m tests.helpers.push_refuser [swarm.serve arguments...]

``start_push_refuser`` starts one in a ``LocalSwarm`` (announcing itself ten times faster than the honest test
servers, so clients route to it first), which stops it with its own peers."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

from swarm.launch import LocalSwarm, PeerProcess
from tests.helpers.wrapped import start_wrapped


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
    return start_wrapped(swarm, "tests.helpers.push_refuser", [], span, "push-refuser", ["--throughput", "1000"], wait)


def main(argv: list[str]) -> int:
    install()
    from swarm.serve import main as serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
