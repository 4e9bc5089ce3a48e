"""The client's side of chained inference steps (the server's is ``peers.rpc.chain``): one trip through the whole
route per step, and a long step cut into chunks that flow through the servers one behind the other.

The client opens its session on every hop (all at once), gives each hop the route it signed, and sends a step to the
first hop only, for the rest of the route. Each server passes its output on and sends the client its output with a
signed commitment: digests of what it took in and what it gave out. The client checks, hop after hop, that each
commitment is signed by the key the hop's identity certified, that the output it got matches its digest, and that
each hop took in exactly what the one before it gave out; so the history it keeps for replays (each hop's inputs)
is what the servers really computed on. A hop that fails, stays silent past its deadline or breaks the digests is
reported to the caller, which repairs the plan; the repaired chain sends the step again from that hop, and the hops
after it redo it (a server takes the start of its last step again: ``peers.serving.sessions``). Replies of an earlier
attempt still in a stream are told apart by the step's ``tag`` and skipped."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from swarm import wire
from swarm.client import replies
from swarm.client.connection import RTT_SLACK
from swarm.codecs import Codec
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.identity import Signed
from swarm.protocol import ChainHop, ChainRoute, InferenceRequest, InferenceStep, OpenReply, OpenSession, StepReply
from swarm.rpc.commit import ChainCopy, CommitKey, binding, digest
from swarm.rpc.remote import Remote, Tensors, unavailable
from swarm.rpc.stream import InferenceStream, open_session

_SAVING = {Codec.none: 0, Codec.float16: 1, Codec.bfloat16: 1, Codec.uint8: 2, Codec.quantile8: 2, Codec.block8: 2}
MAX_STALE = 64  # replies of abandoned attempts skipped in one read before the stream counts as broken


@dataclass
class HopState:
    hop: Hop
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # per hop: one server may hold two hops
    stream: InferenceStream | None = None
    broken: bool = False  # failed (or too slow): the next attempt replaces it
    slow_steps: int = 0
    send_adapter: bool = False  # open with the adapter's tensors even if the server should have them
    inputs: list[torch.Tensor] = field(default_factory=list)  # hidden it took in at each step (client dtype)
    positions: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor | None] = field(default_factory=list)  # its output at each step, as received (None:
    # verified and dropped: ``swarm.client.verify``)
    commit: CommitKey | None = None  # checks its commitments (from its opening reply)
    opening: OpenReply | None = None  # that opening reply (evidence against it carries its certified key)
    lossy: bool = False  # a lossy codec carried its activations (verification then allows for the rounding)
    generation: int = -1  # the route generation it was given
    acks: list[float] = field(default_factory=list)  # when each opening/route message still unanswered was sent
    commitments: list[StepReply] = field(default_factory=list)  # every commitment it sent, oldest first
    # by step (index into ``inputs``): what it took in and gave out beyond what was kept of the step (rejected
    # drafts), as evidence needs them: its commitment covers the whole step
    tails: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    chain: ChainCopy = field(init=False)  # their hash chain, and the latest signature over it (``Chain.audit``)

    def __post_init__(self) -> None:
        self.chain = ChainCopy(self.session_id, binding(self.hop.start, self.hop.end, False))

    def bind(self, opening: OpenSession) -> None:
        """Seed its chain as the server does for this opening (its blocks, and whether an adapter runs there)."""
        self.chain = ChainCopy(self.session_id, binding(opening.start, opening.end, opening.adapter is not None))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

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

    def chain_hop(self) -> ChainHop:
        h = self.hop
        return ChainHop(peer_id=h.peer_id, session_id=self.session_id, direct=h.direct, maddrs=h.maddrs[:8])


@dataclass(frozen=True)
class Chunk:
    """One piece of a step: positions ``start:end`` of it (``offset`` + those in the session)."""

    start: int
    end: int


def chunks(n: int, size: int) -> list[Chunk]:
    """A step of ``n`` tokens cut into pieces of at most ``size`` (``size`` <= 0: one piece)."""
    if size <= 0 or n <= size:
        return [Chunk(0, n)]
    return [Chunk(s, min(s + size, n)) for s in range(0, n, size)]


class Chain:
    """Runs steps through a list of hop states, chained; owned by one inference session."""

    def __init__(
        self,
        remote: Remote,
        open_request: Callable[[HopState], tuple[OpenSession, Tensors]],
        open_timeout: float,
        rtt: dict[str, float],
        observe: Callable[[HopState, float, int], Awaitable[None]],
    ) -> None:
        self.remote = remote
        self.open_request = open_request  # the opening of one hop (its adapter part, if any)
        self.open_timeout = open_timeout
        self.rtt = rtt  # peer id -> measured round trip (s), shared by the client's sessions
        self.observe = observe  # each hop's share of a step's time (routing's estimates, moving slow hops)
        self.generation = 0
        self._signed: tuple[int, tuple[str, ...], Signed] | None = None
        self._tag = 0

    def route(self, states: list[HopState]) -> Signed:
        """The signed route over ``states`` (signed once per generation and route: ~1 ms of RSA)."""
        key = tuple(s.session_id for s in states)
        if self._signed is None or self._signed[:2] != (self.generation, key):
            route = ChainRoute(
                client=self.remote.creds.peer_id, generation=self.generation, hops=tuple(s.chain_hop() for s in states)
            )
            payload = route.model_dump_json()
            signed = Signed(
                public_key=self.remote.creds.public_key,
                payload=payload,
                signature=self.remote.creds.sign(payload.encode()),
            )
            self._signed = (self.generation, key, signed)
        return self._signed[2]

    async def prepare(self, states: list[HopState], route: list[HopState]) -> None:
        """Open (all at once) every hop of ``states`` that has no stream, and give every one of them the current
        route over ``route``; their acknowledgements are read with the step's replies, costing no extra trip."""
        signed = self.route(route)

        async def one(state: HopState) -> None:
            if state.stream is None:
                opening, tensors = self.open_request(state)
                state.bind(opening)
                state.stream = await open_session(self.remote, state.hop, self.open_timeout)
                state.acks.append(time.perf_counter())
                await state.stream.send(InferenceRequest(open=opening, route=signed), tensors)
            elif state.generation < self.generation:
                state.acks.append(time.perf_counter())
                await state.stream.send(InferenceRequest(route=signed), {})
            state.generation = self.generation

        todo = [s for s in states if s.stream is None or s.generation < self.generation]
        if not todo:
            return  # the usual decode step: every hop open under the current route, no task to make
        results = await asyncio.gather(*(one(s) for s in todo), return_exceptions=True)
        for state, result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                state.broken = True
                raise result

    def codec(self, states: list[HopState], piece: torch.Tensor) -> Codec:
        """One codec for a chained step's activations on every link it crosses: what the slowest link calls for
        (each link's own choice, ``Remote.codec_for``; the most compressing of them)."""
        choices = [self.remote.codec_for(s.hop, {"hidden": piece}) for s in states]
        return max(choices, key=lambda c: _SAVING.get(c, 0))

    def deadline(self, states: list[HopState], upto: int, base: float) -> float:
        """How long hop ``upto`` of a chained step may take to answer: the compute allowance ``base`` plus a few
        measured round trips per hop the step crosses to reach it (unmeasured hops count nothing)."""
        return base + RTT_SLACK * sum(self.rtt.get(s.hop.peer_id, 0.0) for s in states[: upto + 1])

    async def run(
        self,
        states: list[HopState],
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        explicit: torch.Tensor,
        position: int,
        chunk: int,
        base_timeout: Callable[[int], float],
        done: list[torch.Tensor],
        replay: bool = False,
    ) -> None:
        """Send ``hidden`` (one step of the session, at ``position``) through ``states`` in one trip, in chunks of
        ``chunk`` tokens, appending each hop's output (client dtype) to ``done`` as it arrives, and recording each
        hop's input and commitments. A hop that fails is marked broken (with the hop before it, when the two
        disagree on what passed between them) and its error raised; the hops before it keep what they did.
        ``replay``: the step is a fresh hop's whole history, which a hop that fails keeps as its inputs all the same
        (its replacement replays them)."""
        self._tag += 1
        tag, first = self._tag, states[0]
        pieces = chunks(hidden.shape[1], chunk)
        assert first.stream is not None
        xs = [hidden[:, c.start : c.end].to(getattr(torch, first.hop.dtype)) for c in pieces]
        codec = self.codec(states, xs[0])
        lossy = codec not in (None, Codec.none)
        if lossy:  # what the first hop takes in, as kept for replays and verification
            hidden = torch.cat([wire.as_received(x, codec) for x in xs], dim=1).to(hidden.dtype)
        digests: list[str] = []
        for c, x in zip(pieces, xs, strict=True):
            tensors: Tensors = {"hidden": x}
            if mask is not None:
                tensors["attention_mask"] = mask[:, : position + c.end]
            if positions is not None:
                tensors["position_ids"] = positions[:, c.start : c.end]
            step = InferenceStep(position=position + c.start, hops=len(states) - 1, tag=tag)
            await first.stream.send(InferenceRequest(step=step), tensors, codec)
            # what the first hop decodes and commits to: worked out while it computes, not before it can start
            digests.append(digest(wire.as_received(x, codec)))
        inputs = hidden
        before = time.perf_counter()
        for k, state in enumerate(states):
            if replay:
                state.inputs, state.positions = [inputs], [explicit]
            try:
                out, digests = await self._collect(
                    state,
                    pieces,
                    position,
                    tag,
                    digests,
                    hidden.shape,
                    self.deadline(states, k, base_timeout(pieces[0].end)),
                )
            except BaseException as e:
                state.broken = True
                state.close()
                if k > 0 and getattr(e, "previous_suspect", False):
                    # the two disagree on what passed between them: one of them lies. Both are replaced, and the
                    # sender is the one banned (what it gave the client is as doubtful as what it passed on)
                    prior = states[k - 1]
                    prior.broken = True
                    prior.close()
                    if not replay:
                        prior.inputs.pop()
                        prior.positions.pop()
                        if prior.outputs:
                            prior.outputs.pop()
                        done.pop()
                    raise unavailable(
                        prior.hop.peer_id,
                        f"gave the next hop ({state.hop.peer_id}) another output than it committed to",
                    ) from e
                raise
            state.lossy |= lossy
            if replay:
                state.outputs = [out]
            else:
                state.inputs.append(inputs)
                state.positions.append(explicit)
                state.outputs.append(out)
            inputs = out.to(hidden.dtype)
            done.append(inputs)
            now = time.perf_counter()  # this hop's share: its compute and one crossing, as a relayed hop sees it
            await self.observe(state, now - before, hidden.shape[1])
            before = now

    async def _collect(
        self,
        state: HopState,
        pieces: list[Chunk],
        position: int,
        tag: int,
        inputs: list[str],
        shape: torch.Size,
        timeout: float,
    ) -> tuple[torch.Tensor, list[str]]:
        """One hop's replies to a chained step: its pending acknowledgements, then one reply per chunk."""
        try:
            return await self._replies(state, pieces, position, tag, inputs, shape, timeout)
        except SwarmError as e:
            raise replies.distrust(e, state.hop.peer_id) from None

    async def _replies(
        self,
        state: HopState,
        pieces: list[Chunk],
        position: int,
        tag: int,
        inputs: list[str],
        shape: torch.Size,
        timeout: float,
    ) -> tuple[torch.Tensor, list[str]]:
        stream, hop = state.stream, state.hop
        assert stream is not None
        while state.acks:
            opening, _, _ = await stream.receive(OpenReply, self.open_timeout + timeout)
            rtt = time.perf_counter() - state.acks.pop(0)
            old = self.rtt.get(hop.peer_id)
            self.rtt[hop.peer_id] = rtt if old is None else 0.7 * old + 0.3 * rtt
            if state.commit is None:
                state.commit, state.opening = CommitKey(opening, hop.peer_id), opening
            if not state.chain.seal(opening):
                raise unavailable(hop.peer_id, "signed a chain of commitments other than the one it sent")
        outs: list[torch.Tensor] = []
        digests: list[str] = []
        for c, expected_in in zip(pieces, inputs, strict=True):
            want = (shape[0], c.end - c.start, shape[2])
            bound = replies.Expect({"hidden": (want, getattr(torch, hop.dtype))}, True).max_bytes
            for _ in range(MAX_STALE):
                reply, tensors, _ = await stream.receive(StepReply, timeout, bound)
                state.chain.fold(reply)  # every commitment the hop sent, a stale one too, is in its chain
                state.commitments.append(reply)
                if reply.tag == tag:
                    break
            else:
                raise unavailable(hop.peer_id, "kept answering steps of earlier attempts")
            out = tensors.get("hidden")
            if set(tensors) != {"hidden"} or out is None or tuple(out.shape) != want:
                raise unavailable(hop.peer_id, f"replied tensors {sorted(tensors)} unlike {list(want)} hidden")
            self._check(state, reply, out, position + c.start, expected_in)
            outs.append(out)
            digests.append(reply.digest)
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], digests

    @staticmethod
    def audit(states: list[HopState]) -> list[HopState]:
        """Check each hop's latest signature over its chain of commitments, if not yet checked; the hops whose
        signature does not hold. Off the decode path (an Ed25519 check costs about 150 µs, one per hop covers all its
        steps): what a step needs at once, that each output matches its digest and each hop took in what the one
        before gave out, is checked as replies arrive; the signatures make the commitments evidence for later, and
        are checked when a session ends or a hop is replaced."""
        return [state for state in states if not state.chain.audit(state.commit)]

    @staticmethod
    async def seal(states: list[HopState], timeout: float) -> list[HopState]:
        """Ask every live hop whose last steps are not yet signed to sign the head of its chain (the answer to a
        message without a step), so that every commitment of a session that ends well is signed; the hops that
        signed another chain than the one they sent. Best effort: a hop that does not answer in time keeps its last
        steps unsigned (and is not blamed: it may just be gone)."""

        async def one(state: HopState) -> bool:
            stream = state.stream
            if stream is None or state.broken or state.acks or state.chain.length <= state.chain.signed_length:
                return True
            try:
                await stream.send(InferenceRequest(), {})
                opening, _, _ = await stream.receive(OpenReply, timeout, 1 << 16)
            except SwarmError:
                return True
            return state.chain.seal(opening)

        results = await asyncio.gather(*(one(s) for s in states))
        return [s for s, ok in zip(states, results, strict=True) if not ok]

    @staticmethod
    def _check(state: HopState, reply: StepReply, out: torch.Tensor, position: int, expected_in: str) -> None:
        peer = state.hop.peer_id
        if reply.position != position:
            raise unavailable(peer, f"answered position {reply.position} to a step at {position}")
        if state.commit is None:
            raise unavailable(peer, "answered a chained step before certifying its commitment key")
        if digest(out) != reply.digest:
            raise unavailable(peer, "sent an output that does not match its own commitment")
        if reply.input_digest != expected_in:
            error = unavailable(peer, "computed on another input than the previous hop gave out")
            error.previous_suspect = True  # type: ignore[attr-defined]  # either of the two lies: both are replaced
            raise error
        if not bool(torch.isfinite(out).all()):
            raise unavailable(peer, "replied NaN or infinite values to finite inputs")
