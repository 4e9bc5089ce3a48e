"""An inference session: a ``generate`` plan whose ``span_step`` nodes each hold a server-side KV cache, kept in
step. The plan is compiled once per route and runs through the executor at every step; this is its remote part.

A step runs the whole chain in one trip to the event loop. Each node remembers what it was sent. When a node fails
(error, dropped connection, or no answer within the step timeout), the retry helper bans its peer and runs the step
again from that node: the plan is repaired (the node rebound to a new route over its blocks, possibly several
peers) and the node's remembered inputs are replayed onto the replacement, which rebuilds the cache, so the session
goes on from the same position. A node that stays far slower than its server announced is moved the same way, if
another route exists."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import torch

from swarm.client import hop_requests, replies
from swarm.client.adapters import AdapterDelivery
from swarm.client.chain import Chain, HopState
from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context, PlanCache, Schedule, schedule
from swarm.client.history import TokenHistory
from swarm.client.session_routes import SessionRoutes
from swarm.client.verdicts import act
from swarm.client.verify import Verifier
from swarm.errors import AdapterMissingError, SessionLengthError
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, generate_plan, repair
from swarm.plan.ir import Plan, SpanStep
from swarm.protocol import OpenSession
from swarm.records import Capability
from swarm.rpc.remote import Tensors, unavailable
from swarm.rpc.stream import open_session

log = logging.getLogger(__name__)


class InferenceSession:
    def __init__(
        self,
        conn: SwarmConnection,
        delivery: AdapterDelivery | None,
        max_length: int,
        batch_size: int,
        model: ModelShape,
        plans: PlanCache,
        prefix: int = 0,
    ) -> None:
        self.conn = conn
        self.delivery = delivery
        self.max_length = max_length
        self.batch_size = batch_size
        self.model = model
        self.plans = plans
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self.history = TokenHistory(prefix)
        self.plan: Plan | None = None  # the generate plan of the current route (repaired as nodes fail)
        self._schedule: Schedule | None = None
        self._ids: list[str] = []  # its span_step nodes, in chain order
        self._states: dict[str, HopState] = {}
        self._generation = 0
        self.closed = False
        needs = {Capability.INFERENCE} | ({Capability.ADAPTERS} if delivery is not None else set())
        self.routes = SessionRoutes(conn, batch_size, max_length, frozenset(needs), self.session_id)
        self._chain_steps = Chain(conn.remote, self._opening, conn.timing.open_timeout, conn.rtt, self.routes.observe)
        self.verifier = (  # each hop's work run again elsewhere, window by window (``swarm.client.verify``)
            Verifier(conn, self._opening, max_length, batch_size, self._chunk, frozenset(needs))
            if conn.cfg.verify_every > 0
            else None
        )
        self.caught: list[str] = []  # servers this session caught computing wrong answers
        # speculative decoding (``swarm.client.speculative``): a provisional step's drafts may still be taken back,
        # so its hops' records are not checked before ``take_back`` cuts them to what was accepted
        self.provisional = False
        self._unconfirmed = False
        self._last_n = 0  # positions of the last step (what ``take_back`` may cut)

    @property
    def route(self) -> list[Hop]:
        return [self._states[i].hop for i in self._ids]

    @property
    def hop_states(self) -> list[HopState]:
        """Each hop's state in chain order: its server, inputs, and (chained) signed commitments."""
        return self._all_states

    @property
    def failovers(self) -> int:
        return self.conn.retrier.failovers

    # ---- the plan -------------------------------------------------------------------------------------------------
    def _bind(self, plan: Plan, schedule: Schedule | None, route: list[Hop]) -> None:
        self.plan, self._schedule = plan, schedule
        self._ids = [n.id for n in plan.order() if isinstance(n, SpanStep)]
        self._states = {i: HopState(hop) for i, hop in zip(self._ids, route, strict=True)}

    def plan_for(self, prompts: int) -> tuple[Plan, Schedule]:
        """The plan of the next step (``prompts``: the first, which puts the trainable prompts in front): compiled
        once per route, routed when the session takes its first step."""
        if self.plan is None:
            route = self.conn.retrier.run(lambda: self.routes.new(0, self.model.num_blocks), "route")
            self._bind(*self._compiled(route, 0), route)
        assert self.plan is not None
        if prompts:
            return self._compiled(self.route, prompts)
        if self._schedule is None:  # repaired: its schedule is worked out once more
            self._schedule = schedule(self.plan)
        return self.plan, self._schedule

    def _compiled(self, route: list[Hop], prompts: int) -> tuple[Plan, Schedule]:
        key = ("generate", tuple(route), self.max_length, prompts, self.batch_size)
        return self.plans.get(
            key, lambda: generate_plan(self.model, route, max_length=self.max_length, prompts=prompts)
        )

    def segment(self, plan: Plan, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The plan's remote part: one step through every ``span_step`` node."""
        return self.step(hidden, ctx.mask, ctx.positions)

    async def _replace(self, index: int) -> None:
        """Repair the plan: rebind node ``index`` to new servers for its blocks and replay its history onto them."""
        node_id = self._ids[index]
        old = self._states[node_id]
        old.close()
        self.audit()
        route = await asyncio.to_thread(self.routes.new, old.hop.start, old.hop.end)
        assert self.plan is not None
        self._generation += 1
        plan, ids = repair(self.plan, node_id, route, self._generation)
        fresh = [HopState(hop) for hop in route]
        log.info(
            "replacing a hop",
            extra={"peer": old.hop.peer_id, "span": f"{old.hop.start}:{old.hop.end}", "session": self.session_id},
        )
        if self.conn.cfg.chain:  # the repair comes first: the route the fresh hops are given must name them
            before = (self.plan, self._schedule, dict(self._states), list(self._ids))
            self.plan, self._schedule = plan, None
            del self._states[node_id]
            self._states.update(zip(ids, fresh, strict=True))
            self._ids[index : index + 1] = ids
            self._chain_steps.generation += 1
            try:
                if old.inputs:  # the history, through the fresh hops only, in pipelined chunks like any long step
                    await self._replay(fresh, old)
            except BaseException:
                # a fresh hop failed before it held the history (one that cannot even be opened keeps none): the old
                # node goes back, still broken, so the next attempt replaces it again with its whole history
                self.plan, self._schedule, self._states, self._ids = before
                for state in fresh:
                    state.close()
                raise
            return
        if old.inputs:
            hidden = torch.cat(old.inputs, dim=1)
            positions = torch.cat(old.positions, dim=1)
            mask = None if self.history.mask is None else self.history.mask[:, : self.position]
            try:
                for state in fresh:
                    state.inputs, state.positions = [hidden], [positions]
                    hidden = await self._exchange(state, hidden, mask, positions, 0)
                    state.outputs = [hidden]
            except BaseException:
                for state in fresh:
                    state.close()
                raise
        self.plan, self._schedule = plan, None
        del self._states[node_id]
        self._states.update(zip(ids, fresh, strict=True))
        self._ids[index : index + 1] = ids

    async def _replay(self, fresh: list[HopState], old: HopState) -> None:
        await self._chain_steps.prepare(fresh, self._all_states)
        mask = None if self.history.mask is None else self.history.mask[:, : self.position]
        positions = torch.cat(old.positions, dim=1)
        history = torch.cat(old.inputs, dim=1)
        await self._chain_steps.run(
            fresh, history, mask, positions, positions, 0, self._chunk, self._base_timeout, [], replay=True
        )

    # ---- one hop --------------------------------------------------------------------------------------------------
    def _opening(self, state: HopState) -> tuple[OpenSession, Tensors]:
        return hop_requests.opening(state, self.delivery, self.max_length, self.batch_size)

    def _timeout(self, hidden: torch.Tensor, peer_id: str) -> float:
        return self.conn.timeout(self._base_timeout(hidden.shape[1]), peer_id)

    def _base_timeout(self, tokens: int) -> float:
        """A step's compute allowance: short for a few tokens (a frozen server is found fast), long otherwise."""
        timing = self.conn.timing
        small = self.batch_size * tokens <= self.conn.cfg.small_step_tokens
        return timing.step_timeout if small else timing.request_timeout

    @property
    def _chunk(self) -> int:
        """Tokens per piece of a long step (deep prompts must arrive whole in the first step: no pieces then)."""
        return self.conn.cfg.prefill_chunk if self.delivery is None else 0

    @property
    def _all_states(self) -> list[HopState]:
        return [self._states[i] for i in self._ids]

    async def _exchange(
        self,
        state: HopState,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        position: int,
    ) -> torch.Tensor:
        opening = state.stream is None
        request, tensors = hop_requests.step_request(state, hidden, mask, positions, position, self._opening)
        if state.stream is None:
            state.stream = await open_session(self.conn.remote, state.hop, self.conn.timing.open_timeout)
        t0 = time.perf_counter()
        try:
            expect = replies.expected(request, tensors)
            codec = self.conn.remote.codec_for(state.hop, tensors)
            call = state.stream.exchange(
                request, tensors, self._timeout(hidden, state.hop.peer_id), expect.max_bytes, codec
            )
            out = (await replies.checked(state.hop.peer_id, expect, call))["hidden"]
        except AdapterMissingError:
            if not opening or state.send_adapter or self.delivery is None:
                raise
            # the server dropped its cached copy: open this hop again, with the adapter's tensors this time
            self.delivery.delivered(state.hop, False)
            state.stream, state.send_adapter = None, True
            return await self._exchange(state, hidden, mask, positions, position)
        await self.routes.observe(state, time.perf_counter() - t0, hidden.shape[1])
        return out.to(hidden.dtype)

    async def _chain(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        explicit: torch.Tensor,
        done: list[torch.Tensor],
    ) -> torch.Tensor:
        """The chain from the first hop not ``done`` in this step: route it first if there is none yet, replace a
        broken hop, open a new one. A hop that fails is marked broken and the error goes to the retry helper."""
        h = done[-1] if done else hidden
        while len(done) < len(self._ids):
            index = len(done)
            if self.conn.cfg.chain:
                await self._chained(index, h, mask, positions, explicit, done)
                return done[-1]
            if self._states[self._ids[index]].broken:
                await self._replace(index)
            state = self._states[self._ids[index]]
            try:
                out = await self._exchange(state, h, mask, positions, self.position)
            except BaseException:
                state.broken = True
                state.close()
                raise
            state.inputs.append(h)
            state.positions.append(explicit)
            state.outputs.append(out)
            done.append(out)
            h = out
        return h

    async def _chained(
        self,
        index: int,
        h: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        explicit: torch.Tensor,
        done: list[torch.Tensor],
    ) -> None:
        """The rest of the chain from node ``index`` in one trip: broken hops replaced first, every hop opened or
        told the current route, the step sent to the first of them (``swarm.client.chain``)."""
        i = index
        while i < len(self._ids):
            if self._states[self._ids[i]].broken:
                await self._replace(i)  # may put several hops in its place: look at the same index again
                continue
            i += 1
        rest = [self._states[n] for n in self._ids[index:]]
        try:
            await self._chain_steps.prepare(rest, self._all_states)
            await self._chain_steps.run(
                rest, h, mask, positions, explicit, self.position, self._chunk, self._base_timeout, done
            )
        except AdapterMissingError as e:  # a server dropped its copy of the adapter: open it again, tensors included
            state = next((s for s in rest if s.hop.peer_id == e.peer_id), None)
            if state is None or state.send_adapter or self.delivery is None or self.position:
                raise
            self.delivery.delivered(state.hop, False)
            state.stream, state.send_adapter, state.broken, state.generation = None, True, False, -1
            state.acks.clear()
            await self._chained(len(done), done[-1] if len(done) > index else h, mask, positions, explicit, done)

    # ---- a step through every hop ---------------------------------------------------------------------------------
    def step(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run ``hidden`` [batch, n, hidden] through every block; ``attention_mask`` covers all positions so far."""
        if self.closed:
            raise SessionLengthError("this inference session is closed")
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise SessionLengthError(f"session opened for batch {self.batch_size}, got batch {batch}")
        if self.position + n > self.max_length:
            raise SessionLengthError(
                f"session of max_length {self.max_length} is at {self.position}; {n} more tokens do not fit"
            )
        if attention_mask is not None:
            self.history.mask = attention_mask.to(torch.int64)
        mask = self.history.mask  # a padded session keeps sending the mask of every position so far
        # replays need explicit positions even where the server could infer them
        explicit = position_ids if position_ids is not None else torch.arange(self.position, self.position + n)
        explicit = explicit.expand(batch, -1) if explicit.ndim == 1 else explicit
        if self.plan is None:
            self.plan_for(0)
        self._confirm()
        if self.verifier is not None:  # the checks that finished: a cheating hop is replaced before this step
            self.caught += act(self.verifier.settle(), self.conn, self._chunk)
        done: list[torch.Tensor] = []  # outputs of the nodes this step got through, kept across attempts
        conn = self.conn
        out = conn.retrier.run(
            lambda: conn.loop.run(self._chain(hidden, mask, position_ids, explicit, done)),
            "inference step",
            confirm=True,
        )
        self.position += n
        self._last_n = n
        if self.verifier is not None and mask is not None and not bool((mask == 1).all()):
            self.verifier.stop()  # padding: steps are no plain prefixes; not verified (yet)
        self._unconfirmed = True
        if not self.provisional:
            self._confirm()
        return out

    def _confirm(self) -> None:
        """The last step is final: its hops' records go to verification (or their outputs are let go)."""
        if not self._unconfirmed:
            return
        self._unconfirmed = False
        if self.verifier is not None:
            self.verifier.after_step(self._all_states)
        else:  # outputs are kept only for verification
            for state in self._all_states:
                state.outputs.clear()

    def take_back(self, drop: int) -> None:
        """Forget the last ``drop`` positions of the last step (a speculative step's rejected drafts; its first
        position stays). Every hop's records of them are cut and the next step starts after what is kept: that is
        where each server undoes the rest (``peers.serving.sessions``). Then the step is final."""
        if not 0 <= drop < max(self._last_n, 1) or not self._unconfirmed:
            raise SessionLengthError(f"cannot take back {drop} positions of a last step of {self._last_n}")
        if drop:
            for state in self._all_states:
                state.take_back(drop)
            self.position -= drop
            self._last_n -= drop
            self.history.take_back(drop, self.position)
        self._confirm()

    def audit(self) -> None:
        """Check the signatures of the hops' commitments so far; a hop whose signature does not hold is banned and
        replaced at the next step (``Chain.audit``)."""
        for state in Chain.audit(list(self._states.values())):
            state.broken = True
            error = unavailable(state.hop.peer_id, "signed its commitments with a key it did not certify")
            self.conn.retrier.note_failure(error, "commitment audit")

    def seal(self) -> None:
        """Have every live hop sign the head of its chain of commitments, so the session's last steps are signed too
        (``Chain.seal``); a hop that signs another chain than the one it sent is banned."""
        timeout = self.conn.timing.notice_timeout
        try:
            bad = self.conn.loop.run(Chain.seal(list(self._states.values()), timeout), timeout + 1.0)
        except Exception as e:  # noqa: BLE001 - best effort at the session's end: its tokens are already out
            log.info("sealing the session's commitments failed: %s", e, extra={"session": self.session_id})
            return
        for state in bad:
            error = unavailable(state.hop.peer_id, "signed a chain of commitments other than the one it sent")
            self.conn.retrier.note_failure(error, "commitment seal")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._confirm()
                if self.verifier is not None:  # the steps since each hop's last check are checked before it ends
                    self.caught += act(self.verifier.finish(self.conn.timing.request_timeout), self.conn, self._chunk)
            finally:
                try:
                    if self.verifier is not None:
                        self.verifier.close()
                    if self.conn.cfg.chain:
                        self.seal()
                    self.audit()
                finally:
                    for state in self._states.values():
                        state.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
