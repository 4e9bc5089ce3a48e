"""What a chained hop answers a step, read and checked: its acknowledgements of opening and route messages, then one
reply per piece of the step, each with the commitment its output must match (``swarm.rpc.commit``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from swarm.client import replies
from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState
from swarm.client.session.steps import Chunk
from swarm.errors import DisagreedInputError
from swarm.protocol import OpenReply, StepReply
from swarm.rpc.commit import digest
from swarm.rpc.remote import unavailable

MAX_STALE = 64  # replies of abandoned attempts skipped in one read before the stream counts as broken
UNTIMED = -1.0  # an acknowledgement whose round trip is not measured (a keep-alive's: read only at the next step)


@dataclass(frozen=True)
class Sent:
    """A step as sent to the first hop: its pieces, the digest of each as the first hop decodes it, what the first
    hop takes in (client dtype, through the codec), whether the codec is lossy, and the step's tag."""

    pieces: list[Chunk]
    digests: list[str]
    hidden: torch.Tensor
    lossy: bool
    tag: int
    claimed: int = 0  # its first positions, claimed instead of sent (``swarm.rpc.claims``)


async def read_acks(conn: SwarmConnection, state: HopState, timeout: float) -> None:
    """The hop's answers to its opening and route messages: each a round trip measured, the first certifying
    its commitment key, each signing the chain of commitments it sent."""
    link, hop = state.link, state.hop
    assert link.stream is not None
    while link.acks:
        opening, _, _ = await link.stream.receive(OpenReply, conn.timing.open_timeout + timeout)
        sent = link.acks.pop(0)
        if sent != UNTIMED:
            conn.view.observe_rtt(hop.peer_id, time.perf_counter() - sent)
        state.commitments.certify(opening, hop.peer_id)
        state.keeps |= opening.keeps
        state.shares |= opening.shares
        if not state.commitments.seal(opening):
            raise unavailable(hop.peer_id, "signed a chain of commitments other than the one it sent")


async def read_outputs(
    state: HopState, sent: Sent, position: int, inputs: list[str], timeout: float
) -> tuple[torch.Tensor, list[str]]:
    """One reply per piece of the step (replies of earlier attempts skipped), each checked: the hop's output and the
    digests it committed to (what the next hop must take in)."""
    hop, stream, shape = state.hop, state.link.stream, sent.hidden.shape
    assert stream is not None
    outs: list[torch.Tensor] = []
    digests: list[str] = []
    for c, expected_in in zip(sent.pieces, inputs, strict=True):
        want = (shape[0], c.end - c.start, shape[2])
        bound = replies.Expect({"hidden": (want, getattr(torch, hop.dtype))}, True).max_bytes
        for _ in range(MAX_STALE):
            reply, tensors, _ = await stream.receive(StepReply, timeout, bound)
            state.commitments.fold(reply)  # every commitment the hop sent, a stale one too, is in its chain
            if reply.tag == sent.tag:
                break
        else:
            raise unavailable(hop.peer_id, "kept answering steps of earlier attempts")
        out = tensors.get("hidden")
        if set(tensors) != {"hidden"} or out is None or tuple(out.shape) != want:
            raise unavailable(hop.peer_id, f"replied tensors {sorted(tensors)} unlike {list(want)} hidden")
        _check(state, reply, out, position + c.start, expected_in)
        state.reused += min(reply.reused, want[1])  # a server's word, bounded by the piece it answered
        outs.append(out)
        digests.append(reply.digest)
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], digests


def _check(state: HopState, reply: StepReply, out: torch.Tensor, position: int, expected_in: str) -> None:
    peer = state.hop.peer_id
    if reply.position != position:
        raise unavailable(peer, f"answered position {reply.position} to a step at {position}")
    if state.commitments.key is None:
        raise unavailable(peer, "answered a chained step before certifying its commitment key")
    if digest(out) != reply.digest:
        raise unavailable(peer, "sent an output that does not match its own commitment")
    if reply.input_digest != expected_in:
        raise DisagreedInputError(peer)
    if not bool(torch.isfinite(out).all()):
        raise unavailable(peer, "replied NaN or infinite values to finite inputs")
