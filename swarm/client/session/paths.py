"""The two ways a step goes through an inference session's hops, behind one interface (``StepPath``):

- ``ChainedPath`` (``ClientConfig.chain``, the default): the step goes to the first hop, each server passes its output
  to the next, and every hop sends the client its output with a signed commitment (``session.chain``);
- ``MediatedPath``: the client sends each hop its input and takes its output back, hop after hop.

Both run a step from the first hop not done yet (the hops before keep what they did), replay a replaced hop's
history onto its fresh hops, run further steps through fresh hops alone (a move's catch-up: ``session.handover``), and
say which hop's server announced in its last reply that it is leaving. A server that dropped its copy of the client's
adapter is opened again with the adapter's tensors, once, through the one rule of ``AdapterDelivery.resend``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import torch

from swarm.client import replies
from swarm.client.connection import SwarmConnection
from swarm.client.session.chain import Chain, Observe, Opening, open_stream
from swarm.client.session.hop import HopState
from swarm.client.session.liveness import judge_silence
from swarm.client.session.requests import step_request
from swarm.client.session.route import BoundRoute
from swarm.client.session.steps import Step
from swarm.client.tuning.adapters import AdapterDelivery
from swarm.codecs import Codec
from swarm.errors import AdapterMissingError, SwarmError
from swarm.protocol import InferenceRequest, OpenReply, StepReply
from swarm.rpc.remote import Tensors


class StepPath(Protocol):
    async def run(self, route: BoundRoute, step: Step, done: list[torch.Tensor]) -> None:
        """Run ``step`` through ``route``'s hops from the first not ``done`` (``done``: outputs of the hops before,
        client dtype), appending each hop's output. A hop that fails is marked broken and the error raised."""
        ...

    async def replay(self, route: BoundRoute, fresh: list[HopState], step: Step) -> None:
        """Give ``fresh`` hops of ``route`` (the repaired one) their whole history, ``step``."""
        ...

    async def extend(self, fresh: list[HopState], step: Step) -> None:
        """Run ``step`` through ``fresh`` hops alone (already replayed), recording it as theirs."""
        ...

    async def keep_alive(self, states: list[HopState]) -> None:
        """Send each of ``states`` (open hops, not broken) a message without a step, which resets its server's idle
        clock (``session.keepalive``); a hop that cannot be reached is marked broken."""
        ...

    def leaving(self, state: HopState) -> bool:
        """Whether the hop's server said in its last reply that it is leaving."""
        ...


def resend_adapter(delivery: AdapterDelivery | None, state: HopState, opening: bool) -> bool:
    """``state``'s server said it lacks the client's adapter: whether to open it again with the tensors (only where
    the call was its opening and they did not go along already), the hop made ready for it if so."""
    if delivery is None or not opening or not delivery.resend(state.hop, state.link.send_adapter):
        return False
    state.link.reopen_with_adapter()
    return True


class ChainedPath:
    def __init__(self, chain: Chain, delivery: AdapterDelivery | None) -> None:
        self.chain, self.delivery = chain, delivery

    async def run(self, route: BoundRoute, step: Step, done: list[torch.Tensor]) -> None:
        rest = route.states[len(done) :]
        if not rest:
            return
        entering = step.entering(done[-1]) if done else step
        try:
            await self.chain.prepare(rest, route.states, route.generation)
            await self.chain.run(rest, entering, done)
        except AdapterMissingError as e:  # deep prompts and adapters are bound at the session's first step only
            state = next((s for s in rest if s.hop.peer_id == e.peer_id), None)
            if state is None or not resend_adapter(self.delivery, state, step.position == 0):
                raise
            await self.run(route, step, done)

    async def replay(self, route: BoundRoute, fresh: list[HopState], step: Step) -> None:
        """Through the fresh hops only, in pipelined chunks like any long step; the route they are given names them."""
        await self.chain.prepare(fresh, route.states, route.generation)
        await self.chain.replay(fresh, step)

    async def extend(self, fresh: list[HopState], step: Step) -> None:
        await self.chain.run(fresh, step, [])

    async def keep_alive(self, states: list[HopState]) -> None:
        await self.chain.keep_alive(states)

    def leaving(self, state: HopState) -> bool:
        replies = state.commitments.replies  # every reply a chained hop sent is kept there
        return bool(replies) and replies[-1].leaving


class MediatedPath:
    def __init__(
        self,
        conn: SwarmConnection,
        delivery: AdapterDelivery | None,
        opening: Opening,
        base_timeout: Callable[[int], float],
        observe: Observe,
    ) -> None:
        self.conn, self.delivery, self.opening = conn, delivery, opening
        self.base_timeout, self.observe = base_timeout, observe
        self._leaving: set[str] = set()  # hops (their session ids) whose server said in its last reply it is leaving

    async def run(self, route: BoundRoute, step: Step, done: list[torch.Tensor]) -> None:
        await self._through(route.states[len(done) :], step, done)

    async def extend(self, fresh: list[HopState], step: Step) -> None:
        await self._through(fresh, step, [])

    def leaving(self, state: HopState) -> bool:
        return state.session_id in self._leaving

    async def _through(self, states: list[HopState], step: Step, done: list[torch.Tensor]) -> None:
        h = done[-1] if done else step.hidden
        for state in states:
            try:
                out = await self.exchange(state, step.entering(h))
            except SwarmError as e:  # a missed deadline: busy (no ban) or dead, as its liveness check says
                state.link.fail()
                raise await judge_silence(self.conn, state.hop, e) from None
            except BaseException:
                state.link.fail()
                raise
            state.replay.record(h, step.explicit, out)
            done.append(out)
            h = out

    async def keep_alive(self, states: list[HopState]) -> None:
        """Each answer read at once: a mediated hop's stream holds nothing unread between steps."""

        async def one(state: HopState) -> None:
            stream = state.link.stream
            assert stream is not None
            try:
                await stream.send(InferenceRequest(), {})
                # its answer (the signed head of its chain of commitments) is read and dropped: only chained hops
                # keep a sealed chain to check it against, and a mediated hop's outputs are checked step by step
                await stream.receive(OpenReply, self.conn.timing.open_timeout, 1 << 16)
            except SwarmError:
                state.link.fail()

        await asyncio.gather(*(one(s) for s in states))

    async def replay(self, route: BoundRoute, fresh: list[HopState], step: Step) -> None:
        hidden = step.hidden
        for state in fresh:
            state.replay.restart(hidden, step.explicit)
            hidden = await self.exchange(state, step.entering(hidden))
            state.replay.outputs = [hidden]

    async def exchange(self, state: HopState, step: Step) -> torch.Tensor:
        """One step to one hop (opened first if it is not yet): its output, client dtype."""
        link, hidden = state.link, step.hidden
        opening = link.stream is None
        request, tensors = step_request(state, hidden, step.mask, step.positions, step.position, self.opening)
        if link.stream is None:
            link.stream = await open_stream(self.conn, state)
        t0 = time.perf_counter()
        try:
            expect = replies.expected(request, tensors)
            codec = self.conn.remote.codec_for(state.hop, tensors)
            timeout = self.conn.timeout(self.base_timeout(step.tokens), state.hop.peer_id)
            call = self._call(state, request, tensors, codec, timeout, expect.max_bytes)
            out = (await replies.checked(state.hop.peer_id, expect, call))["hidden"]
        except AdapterMissingError:
            if not resend_adapter(self.delivery, state, opening):
                raise
            return await self.exchange(state, step)
        await self.observe(state, time.perf_counter() - t0, step.tokens)
        return out.to(hidden.dtype)

    async def _call(
        self, state: HopState, request: InferenceRequest, tensors: Tensors, codec: Codec, timeout: float, bound: int
    ) -> Tensors:
        """The step's message and its reply (what ``InferenceStream.exchange`` does, the reply's leaving flag read)."""
        stream, hop = state.link.stream, state.hop
        assert stream is not None
        t0 = time.perf_counter()
        sent = await stream.send(request, tensors, codec)
        reply, out, received = await stream.receive(StepReply, timeout, bound)
        self.conn.remote.links.observe(hop.peer_id, sent + received, time.perf_counter() - t0, hop.network_mbps)
        (self._leaving.add if reply.leaving else self._leaving.discard)(state.session_id)
        state.reused += min(reply.reused, tensors["hidden"].shape[1])  # a server's word, bounded by the step
        return out
