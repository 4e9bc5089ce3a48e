"""A lying server, in a process of its own: a real ``swarm.serve`` peer (its own identity, DHT peer, record, blocks
and transports) whose compute and inference answers are rewritten in this process only, by the MODE given first:

    python -m tests.helpers.liar MODE [swarm.serve arguments...]

Modes: ``no_hidden`` (a reply without ``hidden``: its tensor under another name), ``oversized`` (the true reply plus
16 MiB of padding), ``bad_input`` (refuses every valid request as bad input), ``oom`` (fails every request with an
internal "CUDA out of memory" error, which the servicer answers with code ``swarm_error``), ``fork`` (in chained
inference, passes the next hop another output than the one it reports to the client), ``blind`` (in chained
inference, claims to see no record of any next hop: refuses every route with ``unknown_hop``, to get an honest next
hop banned by the clients it names it to). It announces itself ten
times faster than the honest test servers, so clients route to it first. ``start_liar`` starts one in a
``LocalSwarm``, which stops it with its own peers."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from swarm.errors import BadInputError
from swarm.launch import LocalSwarm, PeerProcess
from tests.helpers.wrapped import start_wrapped

Tensors = dict[str, torch.Tensor]
MODES = ("no_hidden", "oversized", "bad_input", "oom")  # replies that lie (each liar test starts one of each)
CHAIN_MODES = ("fork", "blind")  # chained steps that lie
PADDING = 4 << 20  # float32 elements: 16 MiB


def lie(mode: str, honest: Callable[[], Awaitable[Tensors]]) -> Callable[[], Awaitable[Tensors]]:
    async def answer() -> Tensors:
        if mode == "bad_input":
            raise BadInputError("hidden must be [batch, seq, 64] (a lie: it is)")
        if mode == "oom":
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        out = await honest()
        if mode == "no_hidden":
            return {("hidden_states" if name == "hidden" else name): t for name, t in out.items()}
        return dict(out, padding=torch.zeros(PADDING))  # oversized

    return answer


def install(mode: str) -> None:
    """Rewrite forward, backward and inference-step answers of this process's server."""
    if mode == "fork":
        return install_fork()
    if mode == "blind":
        return install_blind()
    from peers.serving.pass_service import PassService
    from peers.serving.sessions import SessionTable

    forward, backward, step = PassService.forward, PassService.backward, SessionTable.step

    async def lying_forward(self: PassService, *args: Any) -> Tensors:
        return await lie(mode, lambda: forward(self, *args))()

    async def lying_backward(self: PassService, *args: Any) -> Tensors:
        return await lie(mode, lambda: backward(self, *args))()

    async def lying_step(self: SessionTable, *args: Any) -> Tensors:
        return await lie(mode, lambda: step(self, *args))()

    PassService.forward = lying_forward  # type: ignore[method-assign]
    PassService.backward = lying_backward  # type: ignore[method-assign]
    SessionTable.step = lying_step  # type: ignore[method-assign]


def install_fork() -> None:
    """Push a slightly different output to the next hop than the one the client gets (and commits to)."""
    from peers.rpc.chain import StepPusher

    push = StepPusher.push

    def forking_push(self: StepPusher, session: Any, step: Any, out: torch.Tensor, tensors: Tensors) -> None:
        push(self, session, step, out + 1e-3, tensors)

    StepPusher.push = forking_push  # type: ignore[method-assign]


def install_blind() -> None:
    """Say no record of the route's next hop exists, whatever the DHT holds."""
    from peers.rpc.chain import StepPusher
    from swarm.errors import UnknownHopError

    bind = StepPusher.bind

    async def blind_bind(self: StepPusher, session: Any, signed: Any) -> None:
        await bind(self, session, signed)  # the route checked as an honest hop does: only a next hop is denied
        if session.next_hop is not None:
            session.next_hop = None
            raise UnknownHopError(f"the route's next hop announces no record serving block {session.sub.end} (a lie)")

    StepPusher.bind = blind_bind  # type: ignore[method-assign]


def start_liar(swarm: LocalSwarm, mode: str, span: str, wait: bool = True) -> PeerProcess:
    """A liar serving ``span`` in ``swarm``, started as ``LocalSwarm`` starts its peers (and stopped with them)."""
    return start_wrapped(swarm, "tests.helpers.liar", [mode], span, f"liar-{mode}", ["--throughput", "1000"], wait)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES + CHAIN_MODES:
        print(f"usage: python -m tests.helpers.liar {{{','.join(MODES + CHAIN_MODES)}}} [swarm.serve arguments...]")
        return 2
    install(argv[0])
    from swarm.serve import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
