"""The client's side of chained inference steps (the server's is ``peers.rpc.chain``): one trip through the whole
route per step, and a long step cut into chunks that flow through the servers one behind the other.

The client opens its session on every hop (all at once), gives each hop the route it signed, and sends a step to the
first hop only, for the rest of the route. Each server passes its output on and sends the client its output with a
signed commitment: digests of what it took in and what it gave out. The client checks, hop after hop, that each
commitment is signed by the key the hop's identity certified, that the output it got matches its digest, and that
each hop took in exactly what the one before it gave out; so the history it keeps for replays (each hop's inputs)
is what the servers really computed on. A hop that fails, stays silent past its deadline or breaks the digests is
reported to the caller, which repairs the plan. While it waits for a hop, the client watches the hop before it: a
hop that cannot push the step on ends its session at once with ``NextHopUnreachableError`` (``peers.rpc.chain``),
and the hop it could not reach is the one failed (no wait for the step's deadline, no blame on the reporter beyond
reopening its session). A hop that missed its deadline but answers a liveness check is slow, not dead
(``swarm.client.session.liveness``): replaced without a ban. The caller repairs the plan; the repaired chain sends
the step again from that hop, and the hops after it redo it (a server takes the start of its last step again:
``peers.serving.sessions``). Replies of an earlier attempt still in a stream are told apart by the step's ``tag`` and
skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import torch

from swarm import wire
from swarm.client import replies
from swarm.client.connection import RTT_SLACK, SwarmConnection
from swarm.client.prefix_memory import keys_of
from swarm.client.session.hop import HopState
from swarm.client.session.hop_replies import UNTIMED, Sent, read_acks, read_outputs
from swarm.client.session.liveness import judge_silence
from swarm.client.session.steps import Chunk, Step, chunks
from swarm.codecs import Codec
from swarm.errors import (
    DisagreedInputError,
    NextHopUnreachableError,
    PrefixUnknownError,
    SessionExpiredError,
    SwarmError,
    UnknownHopError,
    UnseenHopError,
)
from swarm.identity import Signed
from swarm.protocol import ChainRoute, InferenceRequest, InferenceStep, OpenSession, PrefixClaim, PrefixUse, StepReply
from swarm.rpc.claims import BLOCK, block_digests, piece_digest
from swarm.rpc.commit import digest
from swarm.rpc.remote import Tensors, unavailable
from swarm.rpc.stream import InferenceStream, open_session

_SAVING = {Codec.none: 0, Codec.float16: 1, Codec.bfloat16: 1, Codec.uint8: 2, Codec.quantile8: 2, Codec.block8: 2}
Opening = Callable[[HopState], tuple[OpenSession, Tensors]]
Observe = Callable[[HopState, float, int], Awaitable[None]]


class Chain:
    """Runs steps through a list of hop states, chained; owned by one inference session, whose hops it opens with
    ``opening``, cuts long steps into pieces of ``chunk`` tokens and gives each step ``base_timeout(tokens)`` of
    compute."""

    def __init__(
        self,
        conn: SwarmConnection,
        opening: Opening,
        chunk: int,
        base_timeout: Callable[[int], float],
        observe: Observe,
        prefix: PrefixUse | None = None,
    ) -> None:
        self.conn, self.opening, self.chunk, self.base_timeout = conn, opening, chunk, base_timeout
        # prefix caching asked for (``peers.serving.prefixes``); ``claim_next``: the next step run is a session's
        # first, and may claim what the first hop kept of an earlier one instead of sending it (``swarm.rpc.claims``)
        self.prefix, self.claim_next = prefix, False
        self.claimed = 0  # positions the first hop answered from claims
        self.observe = observe  # each hop's share of a step's time (routing's estimates, moving slow hops)
        self._signed: tuple[int, tuple[str, ...], Signed] | None = None
        self._route: list[HopState] = []  # the hops of the route last signed, in order
        self._tag = 0

    def signed_route(self, states: list[HopState], generation: int) -> Signed:
        """The signed route over ``states`` (signed once per generation and route: ~1 ms of RSA)."""
        key = tuple(s.session_id for s in states)
        if self._signed is None or self._signed[:2] != (generation, key):
            creds = self.conn.remote.creds
            hops = tuple(s.chain_hop() for s in states)
            payload = ChainRoute(client=creds.peer_id, generation=generation, hops=hops).model_dump_json()
            signed = Signed(public_key=creds.public_key, payload=payload, signature=creds.sign(payload.encode()))
            self._signed, self._route = (generation, key, signed), list(states)
        return self._signed[2]

    def _next_in_route(self, state: HopState) -> HopState | None:
        """The hop after ``state`` in the route this client last signed, if any."""
        i = next((i for i, s in enumerate(self._route) if s is state), None)
        return self._route[i + 1] if i is not None and i + 1 < len(self._route) else None

    async def prepare(self, states: list[HopState], route: list[HopState], generation: int) -> None:
        """Open (all at once) every hop of ``states`` that has no stream, and give every one of them the route over
        ``route`` (of ``generation``); their acknowledgements are read with the step's replies, at no extra trip."""
        signed = self.signed_route(route, generation)
        todo = [s for s in states if s.link.stream is None or s.link.generation < generation]
        if not todo:
            return  # the usual decode step: every hop open under the current route, no task to make
        results = await asyncio.gather(*(self._tell(s, signed, generation) for s in todo), return_exceptions=True)
        failed = [(s, r) for s, r in zip(todo, results, strict=True) if isinstance(r, BaseException)]
        for state, _ in failed:
            state.link.broken = True  # every hop that could not be opened or told: each is replaced
        if failed:
            raise failed[0][1]

    async def _tell(self, state: HopState, signed: Signed, generation: int) -> None:
        link = state.link
        if link.stream is None:
            opening, tensors = self.opening(state)
            state.commitments.bind(opening)
            link.stream = await open_stream(self.conn, state)
            link.rerouted = False  # a fresh session: whatever it says is about this route
            link.acks.append(time.perf_counter())
            await link.stream.send(InferenceRequest(open=opening, route=signed), tensors)
        else:
            link.acks.append(time.perf_counter())
            link.rerouted = True
            await link.stream.send(InferenceRequest(route=signed), {})
        link.generation = generation

    async def keep_alive(self, states: list[HopState]) -> None:
        """A message without a step to each hop (``session.keepalive``), its answer read with the next step's replies
        like a route's acknowledgement (anything still unread in the stream comes before it), no round trip
        measured by it."""

        async def one(state: HopState) -> None:
            link = state.link
            assert link.stream is not None
            try:
                await link.stream.send(InferenceRequest(), {})
            except SwarmError:
                link.fail()
                return
            link.acks.append(UNTIMED)

        await asyncio.gather(*(one(s) for s in states))

    # ---- a step, and a replay --------------------------------------------------------------------------------------
    async def run(self, states: list[HopState], step: Step, done: list[torch.Tensor]) -> None:
        """Send ``step`` through ``states`` in one trip, appending each hop's output (client dtype) to ``done`` as it
        arrives and recording each hop's input. A hop that fails is marked broken (with the hop before it, when the
        two disagree on what passed between them) and its error raised; the hops before it keep what they did."""
        claimable, self.claim_next = self.claim_next, False
        sent = await self._send(states, step, claimable)
        inputs, digests = sent.hidden, sent.digests
        before = time.perf_counter()
        for k, state in enumerate(states):
            try:
                out, digests = await self._collect(states, k, sent, step.position, digests)
            except PrefixUnknownError:
                for key in keys_of(state.hop, self.prefix) if self.prefix is not None else ():
                    self.conn.claims.refused(key)  # it keeps no more of what this client remembers
                raise
            except DisagreedInputError as e:
                if k == 0:  # the client's own input: the first hop alone is wrong
                    raise
                prior = states[k - 1]
                prior.replay.unrecord()  # the step runs again from the sender
                done.pop()
                raise _blame(prior, state) from e
            if k == 0 and sent.claimed and self.prefix is not None:
                self.claimed += sent.claimed
                for key in keys_of(state.hop, self.prefix):
                    self.conn.claims.honoured(key)
            state.replay.lossy |= sent.lossy
            state.replay.record(inputs, step.explicit, out)
            inputs = out.to(step.hidden.dtype)
            done.append(inputs)
            before = await self._observed(state, before, step.tokens)

    async def replay(self, states: list[HopState], step: Step) -> None:
        """Send ``step``, a fresh hops' whole history, through them in one trip: each keeps it as its inputs whether it
        succeeds or fails (its replacement then replays them)."""
        sent = await self._send(states, step)
        inputs, digests = sent.hidden, sent.digests
        before = time.perf_counter()
        for k, state in enumerate(states):
            state.replay.restart(inputs, step.explicit)
            try:
                out, digests = await self._collect(states, k, sent, step.position, digests)
            except DisagreedInputError as e:
                if k == 0:
                    raise
                raise _blame(states[k - 1], state) from e
            state.replay.lossy |= sent.lossy
            state.replay.outputs = [out]
            inputs = out.to(step.hidden.dtype)
            before = await self._observed(state, before, step.tokens)

    async def _observed(self, state: HopState, before: float, tokens: int) -> float:
        now = time.perf_counter()  # this hop's share: its compute and one crossing, as a relayed hop sees it
        await self.observe(state, now - before, tokens)
        return now

    async def _send(self, states: list[HopState], step: Step, claimable: bool = False) -> Sent:
        """Send the step's pieces to the first hop, for the rest of ``states`` (``claimable``: a session's first step,
        whose start the first hop's server may have kept from an earlier session: ``swarm.rpc.claims``)."""
        self._tag += 1
        first = states[0]
        stream = first.link.stream
        assert stream is not None
        pieces = chunks(step.tokens, self.chunk)
        xs = [step.hidden[:, c.start : c.end].to(getattr(torch, first.hop.dtype)) for c in pieces]
        codec = self.codec(states, xs[0])
        lossy = codec not in (None, Codec.none)
        found = self._claim(first, step, xs, codec) if claimable else None
        claimed: list[Chunk] = []
        if found is not None:  # the claimed positions go as pieces without tensors, then the rest as usual
            length = found[0].length
            claimed = chunks(length, self.chunk)
            pieces = claimed + [
                Chunk(length + c.start, length + c.end) for c in chunks(step.tokens - length, self.chunk)
            ]
            xs = [step.hidden[:, c.start : c.end].to(xs[0].dtype) for c in pieces[len(claimed) :]]
        hidden = step.hidden
        taken: list[torch.Tensor | None] = [None] * len(xs)  # each piece as the first hop decodes it, once
        if lossy:  # what the first hop takes in, as kept for replays and verification
            taken = [wire.as_received(x, codec) for x in xs]
            parts = ([found[1]] if found is not None else []) + [t for t in taken if t is not None]
            hidden = torch.cat(parts, dim=1).to(hidden.dtype)
        digests: list[str] = []
        hops = len(states) - 1
        for c in claimed:
            assert found is not None
            claim = found[0].model_copy(update={"end": c.end})
            await stream.send(
                InferenceRequest(step=InferenceStep(position=c.start, hops=hops, tag=self._tag, claim=claim)), {}, codec
            )  # (the codec its output travels in, to the next hop and back, as the rest's)
            digests.append(piece_digest(bytes.fromhex(claim.digest), c.start, c.end))
        for c, x, received in zip(pieces[len(claimed) :], xs, taken, strict=True):
            tensors: Tensors = {"hidden": x}
            if step.mask is not None:
                tensors["attention_mask"] = step.mask[:, : step.position + c.end]
            if step.positions is not None:
                tensors["position_ids"] = step.positions[:, c.start : c.end]
            request = InferenceStep(position=step.position + c.start, hops=hops, tag=self._tag)
            await stream.send(InferenceRequest(step=request), tensors, codec)
            # what the first hop decodes and commits to: worked out while it computes, not before it can start
            digests.append(digest(received if received is not None else wire.as_received(x, codec)))
        return Sent(pieces, digests, hidden, lossy, self._tag, found[0].length if found is not None else 0)

    def _claim(
        self, first: HopState, step: Step, xs: list[torch.Tensor], codec: Codec | None
    ) -> tuple[PrefixClaim, torch.Tensor] | None:
        """The longest start of the step's input (whole blocks, the last position always sent) that an earlier
        session of this client sent the same first hop's server, which said it keeps them (``swarm.rpc.claims``);
        with those positions as that server took them in. None: nothing to claim."""
        if self.prefix is None or step.position or not step.plain or step.tokens <= BLOCK:
            return None
        memory = self.conn.claims
        keys = [key for key in keys_of(first.hop, self.prefix) if memory.has(key)]
        if not keys:
            return None
        taken = torch.cat([wire.as_received(x, codec) for x in xs], dim=1)
        chain = block_digests(b"", taken[:, : ((step.tokens - 1) // BLOCK) * BLOCK])
        k = max(memory.longest(key, chain) for key in keys)
        if not k:
            return None
        return PrefixClaim(length=k * BLOCK, digest=chain[k - 1].hex(), end=k * BLOCK), taken[:, : k * BLOCK]

    def codec(self, states: list[HopState], piece: torch.Tensor) -> Codec:
        """One codec for a chained step's activations on every link it crosses: what the slowest link calls for
        (each link's own choice, ``Remote.codec_for``; the most compressing of them)."""
        choices = [self.conn.remote.codec_for(s.hop, {"hidden": piece}) for s in states]
        return max(choices, key=lambda c: _SAVING.get(c, 0))

    def deadline(self, states: list[HopState], upto: int, base: float) -> float:
        """How long hop ``upto`` of a chained step may take to answer: the compute allowance ``base`` (longer where a
        hop on the way was found slow but alive: ``SwarmView.patience``) plus a few measured round trips per hop the
        step crosses to reach it (unmeasured hops count nothing)."""
        crossed = states[: upto + 1]
        patience = max(self.conn.view.patience(s.hop.peer_id) for s in crossed)
        return base * patience + RTT_SLACK * sum(self.conn.rtt.get(s.hop.peer_id, 0.0) for s in crossed)

    # ---- one hop's replies ----------------------------------------------------------------------------------------
    async def _collect(
        self, states: list[HopState], k: int, sent: Sent, position: int, inputs: list[str]
    ) -> tuple[torch.Tensor, list[str]]:
        """Hop ``k``'s replies to a chained step: its pending acknowledgements, then one reply per piece (each
        checked against ``inputs``, the digests the hop before it committed to); its output and their digests. A
        hop that fails is marked broken (and the one before it, when they disagree on what passed between them)."""
        state = states[k]
        timeout = self.deadline(states, k, self.base_timeout(sent.pieces[0].end))

        async def reading() -> tuple[torch.Tensor, list[str]]:
            await read_acks(self.conn, state, timeout)
            state.link.rerouted = False
            return await read_outputs(state, sent, position, inputs, timeout)

        try:
            return await self._watched(states, k, reading())
        except BaseException as e:
            state.link.fail()
            if isinstance(e, NextHopUnreachableError) and e.declared and state.link.rerouted:
                raise _ended_before(state) from None  # about the next hop it had before: nobody to blame now
            if isinstance(e, NextHopUnreachableError) and e.declared and k + 1 < len(states):
                raise _unreached(state, states[k + 1]) from None  # its next hop is the suspect: failed, not it
            if isinstance(e, UnknownHopError):
                # it sees no record of its next hop serving the blocks after it: a server gone since this client
                # read the swarm (or not yet seen there, then found again after its parole); that one is replaced.
                # The next hop is in the route, and not always among the hops stepped here (a replay to fresh hops
                # whose route goes on past them): left unnamed, each retry would route through it again
                following = states[k + 1] if k + 1 < len(states) else self._next_in_route(state)
                if following is not None:
                    raise _unseen(state, following) from None
            if k > 0 and isinstance(e, DisagreedInputError):
                states[k - 1].link.fail()  # either of the two lies: both are replaced
            if isinstance(e, SwarmError):  # a missed deadline: busy (no ban) or dead, as its liveness check says
                raise await judge_silence(self.conn, state.hop, replies.distrust(e, state.hop.peer_id)) from None
            raise

    async def _watched(
        self, states: list[HopState], k: int, reading: Awaitable[tuple[torch.Tensor, list[str]]]
    ) -> tuple[torch.Tensor, list[str]]:
        """Hop ``k``'s replies (``reading``), while the hop before it is watched: anything it says now is out of
        turn (it answered the whole step already), so it is the error it ended its session with. That it could not
        push the step to hop ``k`` fails hop ``k`` at once (``NextHopUnreachableError``); any other end (its session
        idled out while hop ``k`` computed) marks it for reopening, and hop ``k`` is still waited for."""
        prior = states[k - 1] if k > 0 else None
        stream = prior.link.stream if prior is not None else None
        if prior is None or stream is None or stream.closed:
            return await reading
        heard = stream.watch()
        task = asyncio.ensure_future(reading)
        await asyncio.wait((task, heard), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        try:
            await stream.receive(StepReply, 1.0)  # what the watch read (done): an error reply raises what it names
        except NextHopUnreachableError:
            prior.link.fail()  # its session ended: reopened at the next attempt, with no blame
            task.cancel()  # hop k is failed: its read may stop halfway
            await asyncio.gather(task, return_exceptions=True)
            raise _unreached(prior, states[k]) from None
        except SwarmError:  # it ended its session otherwise (idle while this hop computed): reopened next step
            prior.link.fail()
            return await task
        prior.link.fail()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise unavailable(prior.hop.peer_id, "answered a step it had answered already")


def _ended_before(state: HopState) -> SwarmError:
    """The hop ended its session for a next hop it could not reach before it heard the route this client sent it
    since (the client had replaced that next hop already): its session is reopened, no one is blamed."""
    e = SessionExpiredError(f"peer {state.hop.peer_id} ended its session under an earlier route")
    e.peer_id = state.hop.peer_id
    return e


def _unreached(reporter: HopState, suspect: HopState) -> SwarmError:
    """``reporter`` could not pass the step on to ``suspect``: the suspect is the one failed (and banned for failing,
    which parole lifts before its blocks count as missing); the reporter's session ended, so it is reopened."""
    suspect.link.fail()
    e = NextHopUnreachableError(f"peer {reporter.hop.peer_id} could not reach the next hop {suspect.hop.peer_id}")
    e.peer_id = suspect.hop.peer_id
    return e


def _unseen(reporter: HopState, suspect: HopState) -> SwarmError:
    """``reporter`` sees no record of its next hop ``suspect``, which may be among the hops stepped now or the next of
    the route past them (a replay to fresh hops whose route goes on): both are failed, so the next attempt replaces
    them (the suspect, left in the route, would have every replay refused for it again), and the retry helper judges
    whose view is wrong (``Retrier.note_failure``)."""
    suspect.link.fail()
    e = UnseenHopError(
        f"peer {reporter.hop.peer_id} sees no record of the next hop {suspect.hop.peer_id}",
        reporter.hop.peer_id,
        suspect.hop.start,
    )
    e.peer_id = suspect.hop.peer_id
    return e


async def open_stream(conn: SwarmConnection, state: HopState) -> InferenceStream:
    return await open_session(conn.remote, state.hop, conn.timing.open_timeout)


def _blame(prior: HopState, state: HopState) -> SwarmError:
    """The two disagree on what passed between them: one of them lies. Both are replaced, and the sender is the one
    banned (what it gave the client is as doubtful as what it passed on)."""
    return unavailable(
        prior.hop.peer_id, f"gave the next hop ({state.hop.peer_id}) another output than it committed to"
    )
