"""An inference session: a ``generate`` plan whose ``span_step`` nodes each hold a server-side KV cache, kept in
step. The plan is compiled once per route and runs through the executor at every step; this is its remote part.

A step runs the whole chain in one trip to the event loop, along one of two paths (``session.paths``: chained, or
mediated by the client). Each hop remembers what it was sent (``session.hop``). When a hop fails (error, dropped
connection, or no answer within the step timeout), the retry helper bans its peer and runs the step again from that
hop: the route is repaired (the hop rebound to a new route over its blocks, possibly several peers) and the hop's
remembered inputs are replayed onto the replacement, which rebuilds the cache, so the session goes on from the same
position. A hop that stays far slower than its server announced is moved the same way, if another route exists. A
hop whose server says it is leaving is moved off the step path instead, and taken at a step boundary
(``session.handover``): a polite quit costs no replay a step waits for.
Verification, the commitments' signatures and speculative steps' finality are ``session.checks``'s."""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context, PlanCache, Schedule, schedule
from swarm.client.prefix_memory import key_of
from swarm.client.session.chain import Chain
from swarm.client.session.checks import SessionChecks
from swarm.client.session.handover import Handover
from swarm.client.session.history import TokenHistory
from swarm.client.session.hop import HopState
from swarm.client.session.keepalive import kept_alive
from swarm.client.session.paths import ChainedPath, MediatedPath, StepPath
from swarm.client.session.requests import opening
from swarm.client.session.route import BoundRoute
from swarm.client.session.routes import SessionRoutes
from swarm.client.session.steps import Step
from swarm.client.tuning.adapters import AdapterDelivery
from swarm.client.verify.verifier import Verifier
from swarm.errors import SessionLengthError
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, generate_plan, repair
from swarm.plan.ir import Plan
from swarm.protocol import OpenSession, PrefixUse
from swarm.records import Capability
from swarm.rpc.claims import block_digests
from swarm.rpc.remote import Tensors

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
        scope: str = "",
    ) -> None:
        self.conn, self.delivery, self.max_length, self.batch_size = conn, delivery, max_length, batch_size
        # prefix caching on the servers (``peers.serving.prefixes``), within this client's identity and ``scope``
        cfg = conn.cfg
        self.prefix_use = PrefixUse(scope=scope, share=cfg.share_prefixes) if cfg.prefix_cache else None
        self.model, self.plans = model, plans
        self.session_id, self.position, self.history = uuid.uuid4().hex, 0, TokenHistory(prefix)
        self.bound: BoundRoute | None = None  # the route and its plan (a new value at each repair)
        self._generation = 0  # of the latest repair: its plan's node ids, and the route chained hops are given
        self.closed = False
        needs = {Capability.INFERENCE} | ({Capability.ADAPTERS} if delivery is not None else set())
        self.routes = SessionRoutes(conn, batch_size, max_length, frozenset(needs), self.session_id)
        verifier = (  # each hop's work run again elsewhere, window by window (``swarm.client.verify.verifier``)
            Verifier(conn, self._opening, max_length, batch_size, self._chunk, frozenset(needs))
            if conn.cfg.verify_every > 0
            else None
        )
        self.checks = SessionChecks(conn, verifier, self._chunk, self.session_id)
        self.verifier, self.caught = verifier, self.checks.caught  # the servers it caught computing wrong answers
        self.path: StepPath = (
            ChainedPath(
                Chain(conn, self._opening, self._chunk, self._base_timeout, self.routes.observe, self.prefix_use),
                delivery,
            )
            if conn.cfg.chain
            else MediatedPath(conn, delivery, self._opening, self._base_timeout, self.routes.observe)
        )
        # hops moved off leaving servers off the step path (``session.handover``)
        self.handover = Handover(
            conn,
            self.routes,
            self.path,
            self._repaired,
            lambda: self.history.mask,
            lambda: not (self.provisional or self.checks.pending),
        )
        self.replays_on_step = 0  # histories replayed while a step waited (a failover's repairs)
        # speculative decoding (``swarm.client.speculative.loop``): a provisional step's drafts may still be taken back;
        # ``_last_n``: the last step's positions (what ``take_back`` may cut)
        self.provisional, self._last_n = False, 0
        self._plain = True  # every step at default positions without padding: what a server keeps, and claims name

    @property
    def plan(self) -> Plan | None:
        """The generate plan of the current route (repaired as hops fail)."""
        return None if self.bound is None else self.bound.plan

    @property
    def route(self) -> list[Hop]:
        return [] if self.bound is None else self.bound.route

    @property
    def hop_states(self) -> list[HopState]:
        """Each hop's state in chain order: its server, inputs, and (chained) signed commitments."""
        return [] if self.bound is None else self.bound.states

    @property
    def reused(self) -> int:
        """Positions every hop of the route answered from prefixes its server kept, instead of computing them."""
        return min((state.reused for state in self.hop_states), default=0)

    @property
    def claimed(self) -> int:
        """Positions of its first step the first hop answered from a claim, not sent (``swarm.rpc.claims``)."""
        return self.path.chain.claimed if isinstance(self.path, ChainedPath) else 0

    @property
    def failovers(self) -> int:
        return self.conn.retrier.failovers

    @property
    def moves(self) -> int:
        """Hops moved off servers that quit politely, their histories replayed off the step path."""
        return self.handover.taken

    # ---- the plan -------------------------------------------------------------------------------------------------
    def plan_for(self, prompts: int) -> tuple[Plan, Schedule]:
        """The plan of the next step (``prompts``: the first, which puts the trainable prompts in front): compiled
        once per route, routed when the session takes its first step."""
        if self.bound is None:
            route = self.conn.retrier.run(lambda: self.routes.new(0, self.model.num_blocks), "route")
            self.bound = BoundRoute.bind(*self._compiled(route, 0), route)
        if prompts:
            return self._compiled(self.bound.route, prompts)
        if self.bound.schedule is None:  # repaired: its schedule is worked out once more
            self.bound = self.bound.scheduled(schedule(self.bound.plan))
        assert self.bound.schedule is not None
        return self.bound.plan, self.bound.schedule

    def _compiled(self, route: list[Hop], prompts: int) -> tuple[Plan, Schedule]:
        key = ("generate", tuple(route), self.max_length, prompts, self.batch_size)
        return self.plans.get(
            key, lambda: generate_plan(self.model, route, max_length=self.max_length, prompts=prompts)
        )

    def segment(self, plan: Plan, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The plan's remote part: one step through every ``span_step`` node."""
        return self.step(hidden, ctx.mask, ctx.positions)

    async def _replace(self, index: int) -> None:
        """Repair the route: rebind hop ``index`` to new servers for its blocks, replay its history onto them, and
        take the repaired route (if they fail, the old hop stays, still broken: the next attempt replaces it again).
        The route's other hops are kept alive meanwhile (``session.keepalive``)."""
        assert self.bound is not None
        old = self.bound.states[index]
        old.close()
        self.checks.audit(self.bound.states)
        others = [s for s in self.bound.states if s is not old]
        async with kept_alive(others, self.path.keep_alive, self.conn.timing.session_idle):
            route = await asyncio.to_thread(self.routes.new, old.hop.start, old.hop.end)
            repaired, fresh = self._repaired(self.bound, index, route)
            log.info(
                "replacing a hop",
                extra={"peer": old.hop.peer_id, "span": f"{old.hop.start}:{old.hop.end}", "session": self.session_id},
            )
            try:
                if old.replay.inputs:
                    hidden, positions = old.replay.history()
                    mask = None if self.history.mask is None else self.history.mask[:, : self.position]
                    self.replays_on_step += 1
                    await self.path.replay(repaired, fresh, Step(hidden, mask, positions, positions, 0))
            except BaseException:
                for state in fresh:
                    state.close()
                self.routes.release(route)
                raise
        self.routes.release([old.hop])
        self.bound = repaired

    def _repaired(self, bound: BoundRoute, index: int, route: list[Hop]) -> tuple[BoundRoute, list[HopState]]:
        """``bound`` with hop ``index`` rebound to fresh hops on ``route``, under a new generation; the fresh hops."""
        self._generation += 1
        plan, ids = repair(bound.plan, bound.ids[index], route, self._generation)
        fresh = [HopState(hop) for hop in route]
        return bound.replaced(index, plan, ids, fresh, self._generation), fresh

    async def _attempt(self, step: Step, done: list[torch.Tensor]) -> torch.Tensor:
        """One attempt at ``step`` from the first hop not ``done``: a hop whose move off a leaving server is ready
        moved, and the broken hops from there replaced first; then the moves of leaving hops go on."""
        assert self.bound is not None
        moved = await self.handover.take(self.bound, len(done))
        if moved is not None:
            self.checks.audit(self.bound.states)
            self.bound = moved
        while broken := [i for i in range(len(done), len(self.bound.ids)) if self.bound.states[i].link.broken]:
            # the last first: a fresh hop is given the route, and refuses one whose next hop is broken (a server gone
            # from the swarm), so hops are replaced from the end; each may put several hops in its place
            await self._replace(broken[-1])
        await self.path.run(self.bound, step, done)
        self.handover.notice(self.bound)
        return done[-1] if done else step.hidden

    # ---- one hop's allowances -------------------------------------------------------------------------------------
    def _opening(self, state: HopState) -> tuple[OpenSession, Tensors]:
        return opening(state, self.delivery, self.max_length, self.batch_size, self.prefix_use)

    def _base_timeout(self, tokens: int) -> float:
        """A step's compute allowance: short for a few tokens (a frozen server is found fast), long otherwise."""
        timing = self.conn.timing
        small = self.batch_size * tokens <= self.conn.cfg.small_step_tokens
        return timing.step_timeout if small else timing.request_timeout

    @property
    def _chunk(self) -> int:
        """Tokens per piece of a long step (deep prompts must arrive whole in the first step: no pieces then)."""
        return self.conn.cfg.prefill_chunk if self.delivery is None else 0

    # ---- a step through every hop ---------------------------------------------------------------------------------
    def step(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run ``hidden`` [batch, n, hidden] through every block; ``attention_mask`` covers all positions so far."""
        step = self._admit(hidden, attention_mask, position_ids)
        if self.bound is None:
            self.plan_for(0)
        assert self.bound is not None
        self.checks.before_step(self.bound.states)
        done: list[torch.Tensor] = []  # outputs of the hops this step got through, kept across attempts
        conn = self.conn
        if not self.position and isinstance(self.path, ChainedPath):  # its start may be claimed (``swarm.rpc.claims``)
            self.path.chain.claim_next = self.prefix_use is not None
        out = conn.retrier.run(lambda: conn.loop.run(self._attempt(step, done)), "inference step", confirm=True)
        self.position += step.tokens
        self._last_n = step.tokens
        self.checks.after_step(self.bound.states, step.mask, final=not self.provisional)
        return out

    def _admit(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> Step:
        """The step ``hidden`` makes at the session's position, or ``SessionLengthError`` if it does not fit."""
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
        # a padded session keeps sending the mask of all positions; replays need positions even where servers infer them
        explicit = position_ids if position_ids is not None else torch.arange(self.position, self.position + n)
        explicit = explicit.expand(batch, -1) if explicit.ndim == 1 else explicit
        step = Step(hidden, self.history.mask, position_ids, explicit, self.position)
        self._plain &= step.plain
        return step

    def take_back(self, drop: int) -> None:
        """Forget the last ``drop`` positions of the last step (a speculative step's rejected drafts; its first
        position stays). Every hop's records of them are cut and the next step starts after what is kept: that is
        where each server undoes the rest (``peers.serving.sessions``). Then the step is final."""
        if not 0 <= drop < max(self._last_n, 1) or not self.checks.pending:
            raise SessionLengthError(f"cannot take back {drop} positions of a last step of {self._last_n}")
        if drop:
            for state in self.hop_states:
                state.replay.take_back(drop)
            self.position -= drop
            self._last_n -= drop
            self.history.take_back(drop, self.position)
        self.checks.confirm(self.hop_states)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True  # once: a session closed twice (its ``with`` and the model's close) ends once
        try:
            if self.handover.moves:  # moves under way: their fresh hops closed, their routes released
                try:
                    self.conn.loop.run(self.handover.close(), self.conn.timing.shutdown_timeout)
                except Exception as e:  # noqa: BLE001 - at the session's end: a fresh hop's stream is all it holds
                    log.info("dropping a move failed: %s", e, extra={"session": self.session_id})
            self.checks.finish(self.hop_states, chained=self.conn.cfg.chain)
            self._remember()
        finally:
            for state in self.hop_states:
                state.close()
            self.routes.release(self.route)

    def _remember(self) -> None:
        """What the first hop took in, as the chain of block digests its server keeps it under when the session
        ends (if it said it keeps it), for a later session's claim (``swarm.rpc.claims``)."""
        states = self.hop_states
        if self.prefix_use is None or not self._plain or not states or not self.conn.cfg.chain:
            return
        first = states[0]
        if not first.keeps or first.link.broken or not first.replay.inputs:
            return
        hidden, _ = first.replay.history()
        rows = hidden[:, : self.position].to(getattr(torch, first.hop.dtype))
        self.conn.claims.remember(key_of(first.hop, self.prefix_use, first.shares), block_digests(b"", rows))

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
