"""One hop of an inference session as the client keeps it, in three parts, each changed only through its own
methods:

- ``Link``: the stream to the hop's server and what is still expected on it (written by the step paths);
- ``Replay``: what the hop took in and gave out at each step, so a replacement can be given its whole history, cut
  back when a speculative step's drafts are rejected (written by the step paths, read by verification);
- ``Commitments``: the hop's signed commitments and their hash chain (written as its replies are read, read by
  verification, and by accusations as their evidence).

A ``HopState`` holds one of each for one server session (``session_id``: one server may hold two hops)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import torch

from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.protocol import ChainHop, InferenceRequest, OpenReply, OpenSession, StepReply
from swarm.rpc.commit import ChainCopy, CommitKey, binding
from swarm.rpc.stream import InferenceStream


@dataclass
class Link:
    """The session's stream to one server."""

    stream: InferenceStream | None = None
    broken: bool = False  # failed (or too slow): the next attempt replaces it
    send_adapter: bool = False  # open with the adapter's tensors even if the server should have them
    generation: int = -1  # the route generation it was given
    acks: list[float] = field(default_factory=list)  # when each opening/route message still unanswered was sent
    # a new route was sent on the open stream and not yet acknowledged: what the server says before that ack (its
    # session ended for a next hop it could not reach) is about the route before
    rerouted: bool = False

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def fail(self) -> None:
        """Failed (or doubted): closed, and replaced at the next attempt."""
        self.broken = True
        self.close()

    def reopen_with_adapter(self) -> None:
        """The server dropped its copy of the client's adapter: open the hop again, its tensors included."""
        self.close()
        self.stream, self.send_adapter, self.broken, self.generation = None, True, False, -1
        self.acks.clear()


@dataclass
class Replay:
    """What the hop took in (client dtype) and gave out at each step: its inputs are what a replacement replays."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    # its output at each step, as received (None: verified and dropped: ``swarm.client.verify.verifier``)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    # by step (index into ``inputs``): what it took in and gave out beyond what was kept of the step (rejected
    # drafts), as evidence needs them: its commitment covers the whole step
    tails: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    lossy: bool = False  # a lossy codec carried its activations (verification then allows for the rounding)

    def record(self, hidden: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
        self.inputs.append(hidden)
        self.positions.append(positions)
        self.outputs.append(output)

    def restart(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """A fresh hop is given a whole history as one step (kept even if it fails: its replacement replays it)."""
        self.inputs, self.positions = [hidden], [positions]

    def unrecord(self) -> None:
        """Forget the last step (its output was passed on but doubted: the step runs again)."""
        self.inputs.pop()
        self.positions.pop()
        if self.outputs:
            self.outputs.pop()

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every input so far, and its positions, as one step."""
        return torch.cat(self.inputs, dim=1), torch.cat(self.positions, dim=1)

    def release(self, index: int) -> None:
        """Output ``index`` is checked (or never to be): only the inputs stay, which replays need."""
        self.outputs[index] = None

    def take_back(self, drop: int) -> None:
        """Forget the last ``drop`` positions it took in (a speculative step's rejected drafts: the server drops them
        at the next step). Its commitments stay as signed: they cover what the server really ran."""
        aligned = len(self.outputs) == len(self.inputs)  # outputs are kept only while verification wants them
        while drop > 0 and self.inputs:
            n = self.inputs[-1].shape[1]
            keep = max(n - drop, 0)
            drop -= n - keep
            if keep == 0:
                self.inputs.pop(), self.positions.pop()
                self.tails.pop(len(self.inputs), None)
                if aligned:
                    self.outputs.pop()
                continue
            out = self.outputs[-1] if aligned else None
            self.tails[len(self.inputs) - 1] = (self.inputs[-1][:, keep:], None if out is None else out[:, keep:])
            self.inputs[-1], self.positions[-1] = self.inputs[-1][:, :keep], self.positions[-1][:, :keep]
            if out is not None:
                self.outputs[-1] = out[:, :keep]


class Commitments:
    """The hop's commitments: its certified key (from its opening reply), every commitment it sent (``replies``,
    oldest first), and their hash chain with the latest signature over it."""

    def __init__(self, session_id: str, start: int, end: int) -> None:
        self.session_id = session_id
        self.key: CommitKey | None = None  # checks its commitments
        self.opening: OpenReply | None = None  # the reply that certified it (evidence carries its certified key)
        self.replies: list[StepReply] = []
        self.chain = ChainCopy(session_id, binding(start, end, False))

    def bind(self, opening: OpenSession) -> None:
        """Seed the chain as the server does for this opening (its blocks, and whether an adapter runs there)."""
        self.chain = ChainCopy(self.session_id, binding(opening.start, opening.end, opening.adapter is not None))

    def certify(self, opening: OpenReply, peer_id: str) -> None:
        """The first opening reply certifies the hop's commitment key."""
        if self.key is None:
            self.key, self.opening = CommitKey(opening, peer_id), opening

    def seal(self, opening: OpenReply) -> bool:
        """A signature over the chain's head: whether it signs the chain the hop sent."""
        return self.chain.seal(opening)

    def fold(self, reply: StepReply) -> None:
        self.chain.fold(reply)
        self.replies.append(reply)

    def audit(self) -> bool:
        """Whether the latest signature over the chain holds under the certified key."""
        return self.chain.audit(self.key)

    @property
    def unsigned(self) -> bool:
        """Commitments came after the latest signature."""
        return self.chain.length > self.chain.signed_length


class HopState:
    """One hop: its server (``hop``), its session id there, and the three parts."""

    def __init__(self, hop: Hop) -> None:
        self.hop = hop
        self.session_id = uuid.uuid4().hex  # per hop: one server may hold two hops
        self.link = Link()
        self.replay = Replay()
        self.commitments = Commitments(self.session_id, hop.start, hop.end)
        self.reused = 0  # positions its server answered from a kept prefix (``peers.serving.prefixes``)
        self.keeps = False  # its server said it keeps the session's inputs when it ends (``OpenReply.keeps``)...
        self.shares = False  # ...where every sharing session finds them

    def close(self) -> None:
        self.link.close()

    def chain_hop(self) -> ChainHop:
        h = self.hop
        return ChainHop(peer_id=h.peer_id, session_id=self.session_id, direct=h.direct, maddrs=h.maddrs[:8])


async def seal_chains(states: list[HopState], timeout: float, end: bool = False) -> list[HopState]:
    """Ask every live hop whose last steps are not yet signed to sign the head of its chain of commitments (the
    answer to a message without a step); the hops that signed another chain than the one they sent. A hop that does
    not answer in time keeps its last steps unsigned (and is not blamed: it may just be gone). ``end``: the session
    ends, and hops that keep it (``HopState.keeps``) are asked too, to end it before they answer, so what they keep
    of it is there for the client's next session (``peers.serving.prefixes``)."""

    async def one(state: HopState) -> bool:
        stream, ending = state.link.stream, end and state.keeps
        if stream is None or state.link.broken or state.link.acks or not (state.commitments.unsigned or ending):
            return True
        try:
            await stream.send(InferenceRequest(end=ending), {})
            opening, _, _ = await stream.receive(OpenReply, timeout, 1 << 16)
        except SwarmError:
            return True
        return state.commitments.seal(opening) if state.commitments.unsigned else True

    results = await asyncio.gather(*(one(s) for s in states))
    return [s for s, ok in zip(states, results, strict=True) if not ok]
