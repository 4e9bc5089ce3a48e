"""A client's own inference session on one server, to run again what another server ran: the verifier that mirrors
a hop window by window (each window's decode steps as one prefill on the context it already holds, each prompt as
the hop ran it: ``step_cuts``), a third server that
breaks a tie, or a server re-running an accusation's evidence. Its replies are checked and their commitments kept
like a chained hop's, so a shadow that lies leaves evidence too."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from swarm.client import replies
from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState
from swarm.client.session.steps import chunks
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.protocol import InferenceRequest, InferenceStep, OpenReply, OpenSession, StepReply
from swarm.rpc.commit import digest
from swarm.rpc.remote import Tensors, unavailable
from swarm.rpc.stream import open_session

Opening = Callable[[HopState], tuple[OpenSession, Tensors]]


def plain_opening(max_length: int, batch_size: int) -> Opening:
    """The opening of a shadow without an adapter."""

    def opening(state: HopState) -> tuple[OpenSession, Tensors]:
        h = state.hop
        return (
            OpenSession(
                session_id=state.session_id, start=h.start, end=h.end, max_length=max_length, batch_size=batch_size
            ),
            {},
        )

    return opening


def step_cuts(lengths: Sequence[int]) -> list[int]:
    """Where a re-run of steps of ``lengths`` tokens cuts its pieces: around every step of several tokens (a prompt,
    run as the hop ran it), the single-token steps between them together. In half precision a prefill's first
    positions round by the prefill's length: SmolLM2 in bfloat16 gave position 1 of an 8-token prompt 0.19-0.25
    apart (relative) run alone and run with 60 more tokens after it, where honest outputs may differ by 0.1, and
    verifying a window that began with the prompt as one piece set two honest servers in dispute."""
    cuts, at = set(), 0
    for n in lengths:
        if n > 1:
            cuts |= {at, at + n}
        at += n
    return sorted(c for c in cuts if 0 < c < at)


class Shadow:
    def __init__(self, conn: SwarmConnection, hop: Hop, opening: Opening, chunk: int) -> None:
        self.conn, self.opening, self.chunk = conn, opening, chunk
        self.state = HopState(hop)  # its session id, stream, commitments and their chain
        self.position = 0

    @property
    def hop(self) -> Hop:
        return self.state.hop

    async def _open(self) -> None:
        state, timing = self.state, self.conn.timing
        request, tensors = self.opening(state)
        state.commitments.bind(request)
        state.link.stream = await open_session(self.conn.remote, state.hop, timing.open_timeout)
        await state.link.stream.send(InferenceRequest(open=request), tensors)
        opening, _, _ = await state.link.stream.receive(OpenReply, timing.open_timeout, 1 << 16)
        state.commitments.certify(opening, state.hop.peer_id)

    async def run(self, hidden: torch.Tensor, positions: torch.Tensor, cuts: Sequence[int] = ()) -> torch.Tensor:
        """The server's output for the next positions ``hidden`` [batch, n, hidden] (client dtype back), sent in
        pieces cut at ``cuts`` (``step_cuts``) and of at most ``chunk`` tokens; an unfit reply raises
        ``PeerUnavailableError`` naming the server."""
        try:
            return await self._run(hidden, positions, cuts)
        except SwarmError as e:
            raise replies.distrust(e, self.hop.peer_id) from None

    async def _run(self, hidden: torch.Tensor, positions: torch.Tensor, cuts: Sequence[int]) -> torch.Tensor:
        if self.state.link.stream is None:
            await self._open()
        state, hop = self.state, self.state.hop
        assert state.link.stream is not None
        dtype = getattr(torch, hop.dtype)
        outs: list[torch.Tensor] = []
        bounds = [0, *(c for c in cuts if 0 < c < hidden.shape[1]), hidden.shape[1]]
        spans = zip(bounds, bounds[1:], strict=False)
        pieces = [(a + c.start, a + c.end) for a, b in spans for c in chunks(b - a, self.chunk)]
        for start, end in pieces:
            x = hidden[:, start:end].to(dtype)
            tensors: Tensors = {"hidden": x, "position_ids": positions[:, start:end].to(torch.int64)}
            request = InferenceRequest(step=InferenceStep(position=self.position))
            expect = replies.expected(request, tensors)
            await state.link.stream.send(request, tensors)
            timeout = self.conn.timeout(self.conn.timing.request_timeout, hop.peer_id)
            reply, out_tensors, _ = await state.link.stream.receive(StepReply, timeout, expect.max_bytes)
            state.commitments.fold(reply)
            out = replies.check(out_tensors, expect, hop.peer_id)["hidden"]
            if reply.position != self.position or digest(out) != reply.digest or digest(x) != reply.input_digest:
                raise unavailable(hop.peer_id, "sent a reply unlike its own commitment")
            state.replay.record(x, positions[:, start:end], out)
            self.position += end - start
            outs.append(out)
        return torch.cat(outs, dim=1).to(hidden.dtype)

    async def seal(self) -> bool:
        """Have the server sign the head of this session's chain (evidence against it covers every step)."""
        stream = self.state.link.stream
        if stream is None:
            return False
        try:
            await stream.send(InferenceRequest(), {})
            opening, _, _ = await stream.receive(OpenReply, self.conn.timing.notice_timeout, 1 << 16)
        except SwarmError:
            return False
        return self.state.commitments.seal(opening) and self.state.commitments.audit()

    def close(self) -> None:
        self.state.close()
