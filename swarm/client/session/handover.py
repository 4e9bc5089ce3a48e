"""Moving an inference session's hop off a server that quits politely, with no step waiting for a replay.

A server that is leaving (Ctrl-C or SIGTERM: ``peers.run.leave``) says so in every step reply and keeps serving the
session for a grace period. Seeing it (``StepPath.leaving``), the session starts a move of that hop on the client's
event loop, off the step path, while its steps go on through the leaving server:

1. a route over the hop's blocks without the leaving server (looked for again every ``Timing.view_refresh`` while
   there is none: the broker may be moving the span to a standby);
2. fresh hops on it, given the old hop's whole history (``StepPath.replay``: what the old hop computed, so the
   session's outputs stay exactly the same);
3. catch-ups: the steps the old hop took meanwhile, run through the fresh hops alone (``StepPath.extend``).

At the start of a step attempt, a move whose fresh hops hold exactly the old hop's history is taken (the repaired route
in one assignment, ``BoundRoute``) and the old hop closed: the leaving server has one session fewer to wait for. A
move behind by the last step alone waits for that step's catch-up (a one-step trip through the fresh hops, usually
under way already; a speculative step's is held back until its drafts are judged); a replay is never waited for. If
the server goes before the move is ready, the step fails over as any other (a replay on the step path:
``InferenceSession.replays_on_step``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState
from swarm.client.session.paths import StepPath
from swarm.client.session.route import BoundRoute
from swarm.client.session.routes import SessionRoutes
from swarm.client.session.steps import Step
from swarm.errors import SwarmError
from swarm.hop import Hop

log = logging.getLogger(__name__)
# (route, index, hops) -> the route with node ``index`` rebound to fresh hops on ``hops``, and those fresh hops
Repair = Callable[[BoundRoute, int, list[Hop]], tuple[BoundRoute, list[HopState]]]


@dataclass
class Move:
    """One hop's move: what is ready of it so far."""

    old: HopState
    base: tuple[int, tuple[str, ...]]  # the route it replaces a hop of: (generation, node ids)
    route: list[Hop] = field(default_factory=list)  # the fresh hops' servers, once found
    bound: BoundRoute | None = None  # the session's route with the old hop replaced, once found
    fresh: list[HopState] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # the old hop's inputs (same objects) the fresh ones hold
    replayed: bool = False  # the history given
    busy: asyncio.Task[None] | None = None  # the replay or catch-up under way
    upto: int = 0  # the old hop's inputs the fresh ones hold once ``busy`` is done
    dropped: bool = False

    def live(self) -> bool:
        """Not dropped (asked again after every wait: another task may drop it meanwhile)."""
        return not self.dropped


def same(sent: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Whether ``sent`` is exactly ``inputs``, the very objects (a step taken back or undone replaces or drops one)."""
    return len(sent) == len(inputs) and all(a is b for a, b in zip(sent, inputs, strict=True))


def prefix(sent: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    return len(sent) <= len(inputs) and same(sent, inputs[: len(sent)])


class Handover:
    """The moves of one session's hops, run on the client's event loop (``notice`` and ``take`` are called there)."""

    def __init__(
        self,
        conn: SwarmConnection,
        routes: SessionRoutes,
        path: StepPath,
        repair: Repair,
        mask: Callable[[], torch.Tensor | None],
        settled: Callable[[], bool],
    ) -> None:
        self.conn, self.routes, self.path, self.repair, self.mask = conn, routes, path, repair, mask
        # whether the session's last step is final (a speculative step's drafts may still be taken back: a catch-up
        # that sent them would have to start again)
        self.settled = settled
        self.moves: dict[str, Move] = {}  # by the old hop's session id
        self.taken = 0  # moves taken: hops that left a leaving server with no replay on the step path

    # ---- on the step path: nothing here waits for a replay -----------------------------------------------------
    def notice(self, bound: BoundRoute) -> None:
        """A step went through ``bound``: moves that no longer fit it are dropped, a move starts for each hop whose
        server is leaving, and the fresh hops of the others catch up with the step."""
        here = {s.session_id for s in bound.states}
        for key, move in list(self.moves.items()):
            stale = move.base != (bound.generation, bound.ids) or not prefix(move.sent, move.old.replay.inputs)
            if key not in here or stale:
                self._drop(move)
        for state in bound.states:
            under_way = self.moves.get(state.session_id)
            if under_way is not None:
                self._catch_up(under_way)
            elif self.path.leaving(state):
                log.info("moving a hop off a leaving server", extra={"peer": state.hop.peer_id})
                self.routes.avoid.add(state.hop.peer_id)
                move = self.moves[state.session_id] = Move(state, (bound.generation, bound.ids))
                move.busy = self._task(move, self._prepare(move, bound))

    async def take(self, bound: BoundRoute, first: int) -> BoundRoute | None:
        """At the start of a step attempt from hop ``first``: ``bound`` with a ready move of a hop at ``first`` or
        after taken (its old hop closed), or None."""
        for move in list(self.moves.values()):
            if move.base != (bound.generation, bound.ids) or move.bound is None or move.dropped:
                continue
            if _index(bound, move.old) < first:  # this attempt already went through it
                continue
            inputs = move.old.replay.inputs
            if move.replayed and len(inputs) == len(move.sent) + 1:
                self._catch_up(move)  # the last step's catch-up (if not on its way already): a one-step trip
                if move.busy is not None and move.upto == len(inputs):
                    await asyncio.wait([move.busy])
            if move.busy is not None or move.dropped or not same(move.sent, inputs):
                continue
            if any(s.link.broken for s in move.fresh):
                continue
            del self.moves[move.old.session_id]
            move.old.close()
            self.routes.release([move.old.hop])
            self.taken += 1
            log.info("moved a hop off a leaving server", extra={"peer": move.old.hop.peer_id})
            return move.bound
        return None

    @property
    def ready(self) -> int:
        """Moves the next step would take: their fresh hops hold the old hop's whole history (a reading for callers
        on other threads, of a state the event loop changes)."""
        moves = list(self.moves.values())
        return sum(m.replayed and m.busy is None and m.live() and same(m.sent, m.old.replay.inputs) for m in moves)

    async def close(self) -> None:
        """The session ends: every move still under way is dropped."""
        for move in list(self.moves.values()):
            self._drop(move)

    # ---- off the step path ------------------------------------------------------------------------------------------
    def _task(self, move: Move, work: object) -> asyncio.Task[None]:
        assert asyncio.iscoroutine(work)
        task: asyncio.Task[None] = asyncio.create_task(work)
        task.add_done_callback(lambda t: self._done(move, t))
        return task

    def _done(self, move: Move, task: asyncio.Task[None]) -> None:
        if move.busy is task:
            move.busy = None
        error = None if task.cancelled() else task.exception()
        if error is not None and not move.dropped:
            log.info("a move failed: %s", error, extra={"peer": move.old.hop.peer_id})
            if isinstance(error, SwarmError) and error.peer_id not in (None, move.old.hop.peer_id):
                self.conn.retrier.note_failure(error, "moving a hop")
            self._drop(move)  # the next step starts another, if the server is still leaving
        elif not move.dropped:
            self._catch_up(move)

    async def _prepare(self, move: Move, bound: BoundRoute) -> None:
        old = move.old
        route = await self._route(move)
        if route is None:
            return
        move.route = route
        move.bound, move.fresh = self.repair(bound, _index(bound, old), route)
        inputs, positions = list(old.replay.inputs), list(old.replay.positions)
        move.upto = len(inputs)
        if inputs:
            await self.path.replay(move.bound, move.fresh, self._step(inputs, positions, 0))
        move.sent, move.replayed = inputs, True

    async def _route(self, move: Move) -> list[Hop] | None:
        """A route over the old hop's blocks without its server, looked for until found or the move is dropped (not
        cancelled while it looks: a route found in the thread must still be released)."""
        old = move.old
        while move.live():
            try:
                route = await asyncio.to_thread(
                    self.routes.new, old.hop.start, old.hop.end, frozenset({old.hop.peer_id})
                )
            except SwarmError:  # nobody else has the span yet: the broker may be moving it to a standby
                self.conn.view.invalidate()
                await asyncio.sleep(self.conn.timing.view_refresh)
                continue
            if move.live():
                return route
            self.routes.release(route)
        return None

    def _catch_up(self, move: Move) -> None:
        """Run the steps the old hop took since through the fresh hops, unless something is under way already."""
        if not move.replayed or move.busy is not None or move.dropped:
            return
        n, inputs, positions = len(move.sent), list(move.old.replay.inputs), list(move.old.replay.positions)
        upto = len(inputs) if self.settled() else len(inputs) - 1
        if upto > n and prefix(move.sent, inputs):
            move.upto = upto
            move.busy = self._task(move, self._extend(move, inputs[:upto], positions[:upto]))

    async def _extend(self, move: Move, inputs: list[torch.Tensor], positions: list[torch.Tensor]) -> None:
        n = len(move.sent)
        at = sum(x.shape[1] for x in move.sent)
        await self.path.extend(move.fresh, self._step(inputs[n:], positions[n:], at))
        move.sent = inputs

    def _step(self, inputs: list[torch.Tensor], positions: list[torch.Tensor], at: int) -> Step:
        """The old hop's ``inputs`` (from session position ``at``) as one step, with the session's mask that far."""
        hidden, explicit = torch.cat(inputs, dim=1), torch.cat(positions, dim=1)
        mask = self.mask()
        mask = None if mask is None else mask[:, : at + hidden.shape[1]]
        return Step(hidden, mask, explicit, explicit, at)

    def _drop(self, move: Move) -> None:
        if move.dropped:
            return
        move.dropped = True
        self.moves.pop(move.old.session_id, None)
        if move.busy is not None and move.route:  # still looking for a route: it sees ``dropped`` and ends
            move.busy.cancel()
        for state in move.fresh:
            state.close()
        if move.route:
            self.routes.release(move.route)


def _index(bound: BoundRoute, state: HopState) -> int:
    """Where ``state`` is in ``bound`` (a move is only taken or started on the route it was made for)."""
    return next(i for i, s in enumerate(bound.states) if s is state)
