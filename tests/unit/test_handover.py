"""A session's move off a server that quits politely (``swarm.client.session.handover``), without a network: the
history replayed onto the fresh hops off the step path, the steps taken meanwhile caught up, and the move taken at a
step boundary only when the fresh hops hold exactly what the old hop holds. The step path and the routes are small
stand-ins that record what the handover asks of them (the real ones run in tests/integration/test_polite_quit.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from swarm.client.executor import schedule
from swarm.client.session.handover import Handover
from swarm.client.session.hop import HopState
from swarm.client.session.route import BoundRoute
from swarm.client.session.steps import Step
from swarm.errors import MissingBlocksError
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, generate_plan, repair

SHAPE = ModelShape(model_id="m", num_blocks=8, hidden_size=16, vocab_size=32)


class Path:
    """A step path that runs nothing: it records each replay and catch-up as the fresh hops' history."""

    def __init__(self, leaving: set[str]) -> None:
        self.leaving_peers = leaving
        self.calls: list[tuple[str, int, int]] = []  # (kind, position, tokens)
        self.gate = asyncio.Event()  # catch-ups wait for it (a step under way through the fresh hops)
        self.gate.set()

    def leaving(self, state: HopState) -> bool:
        return state.hop.peer_id in self.leaving_peers

    async def replay(self, route: BoundRoute, fresh: list[HopState], step: Step) -> None:
        self.calls.append(("replay", step.position, step.tokens))
        for state in fresh:
            state.replay.restart(step.hidden, step.explicit)

    async def extend(self, fresh: list[HopState], step: Step) -> None:
        await self.gate.wait()
        self.calls.append(("extend", step.position, step.tokens))
        for state in fresh:
            state.replay.record(step.hidden, step.explicit, step.hidden)


class Routes:
    """Routes over a span: ``missing`` times none, then server ``c``; what was released."""

    def __init__(self, missing: int = 0) -> None:
        self.missing, self.avoid, self.released, self.asked = missing, set(), [], []

    def new(self, start: int, end: int, exclude: frozenset[str] = frozenset()) -> list[Hop]:
        self.asked.append(exclude)
        if self.missing:
            self.missing -= 1
            raise MissingBlocksError(list(range(start, end)))
        return [Hop(peer_id="c", start=start, end=end)]

    def release(self, hops: list[Hop]) -> None:
        self.released += [h.peer_id for h in hops]


def _conn() -> SimpleNamespace:
    view = SimpleNamespace(invalidate=lambda: None)
    return SimpleNamespace(timing=SimpleNamespace(view_refresh=0.01), view=view, retrier=None)


def _setup(path: Path, routes: Routes, settled=lambda: True) -> tuple[Handover, BoundRoute]:
    route = [Hop(peer_id="a", start=0, end=4), Hop(peer_id="b", start=4, end=8)]
    plan = generate_plan(SHAPE, route, max_length=32)
    bound = BoundRoute.bind(plan, schedule(plan), route)
    generation = [0]

    def repaired(b: BoundRoute, index: int, hops: list[Hop]) -> tuple[BoundRoute, list[HopState]]:
        generation[0] += 1
        new_plan, ids = repair(b.plan, b.ids[index], hops, generation[0])
        fresh = [HopState(h) for h in hops]
        return b.replaced(index, new_plan, ids, fresh, generation[0]), fresh

    return Handover(_conn(), routes, path, repaired, lambda: None, settled), bound  # type: ignore[arg-type]


def _step(state: HopState, at: int, n: int) -> None:
    """A step through the hop, as the step path records it."""
    x = torch.arange(at, at + n, dtype=torch.float32).view(1, n, 1)
    state.replay.record(x, torch.arange(at, at + n)[None], x)


async def _settle(handover: Handover) -> None:
    for _ in range(500):
        if all(m.busy is None for m in handover.moves.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the move never settled")


def test_a_move_is_taken_once_the_fresh_hops_hold_the_whole_history():
    async def run() -> None:
        path, routes = Path({"a"}), Routes()
        handover, bound = _setup(path, routes)
        old = bound.states[0]
        _step(old, 0, 5)  # the prompt
        handover.notice(bound)  # the server of hop 0 said it is leaving: a move starts, off the step path
        assert await handover.take(bound, 0) is None  # not ready: the step goes through the leaving server
        await _settle(handover)
        assert path.calls == [("replay", 0, 5)] and routes.asked == [frozenset({"a"})] and "a" in routes.avoid
        assert handover.ready == 1
        _step(old, 5, 1)  # a step through the leaving server meanwhile: the fresh hop is behind by it...
        assert handover.ready == 0
        path.gate.clear()
        handover.notice(bound)  # ...and catches up at once; the next step waits for that one-step trip only
        taking = asyncio.ensure_future(handover.take(bound, 0))
        await asyncio.sleep(0.05)
        assert not taking.done()
        path.gate.set()
        moved = await taking
        assert moved is not None and [h.peer_id for h in moved.route] == ["c", "b"]
        assert moved.states[1] is bound.states[1]  # the hop after keeps its state
        fresh = moved.states[0]
        assert torch.equal(torch.cat(fresh.replay.inputs, dim=1), torch.cat(old.replay.inputs, dim=1))
        assert path.calls[-1] == ("extend", 5, 1)
        assert handover.taken == 1 and routes.released == ["a"] and not handover.moves

    asyncio.run(run())


def test_a_move_behind_by_more_than_the_last_step_is_not_taken():
    async def run() -> None:
        path, routes = Path({"a"}), Routes()
        handover, bound = _setup(path, routes)
        old = bound.states[0]
        _step(old, 0, 5)
        handover.notice(bound)
        await _settle(handover)
        _step(old, 5, 1)
        _step(old, 6, 1)  # two steps the fresh hop has not seen, and no catch-up under way
        assert await handover.take(bound, 0) is None  # not a one-step trip: the step goes through the leaving server
        handover.notice(bound)  # the catch-up of both, off the step path
        await _settle(handover)
        assert path.calls[-1] == ("extend", 5, 2) and await handover.take(bound, 0) is not None

    asyncio.run(run())


def test_a_step_taken_back_after_the_replay_starts_the_move_again():
    async def run() -> None:
        path, routes = Path({"a"}), Routes()
        handover, bound = _setup(path, routes)
        old = bound.states[0]
        _step(old, 0, 3)
        _step(old, 3, 4)  # a speculative step...
        handover.notice(bound)
        await _settle(handover)
        old.replay.take_back(2)  # ...whose last two drafts were rejected: the fresh hop holds them
        assert handover.ready == 0
        handover.notice(bound)  # the move is dropped (its hop closed, its route released), another starts
        assert routes.released == ["c"]
        await _settle(handover)
        assert path.calls == [("replay", 0, 7), ("replay", 0, 5)]
        moved = await handover.take(bound, 0)
        assert moved is not None and handover.taken == 1

    asyncio.run(run())


def test_a_speculative_step_is_caught_up_once_its_drafts_are_judged():
    async def run() -> None:
        path, routes = Path({"a"}), Routes()
        final = [True]
        handover, bound = _setup(path, routes, lambda: final[0])
        old = bound.states[0]
        _step(old, 0, 3)
        handover.notice(bound)
        await _settle(handover)
        final[0] = False
        _step(old, 3, 4)  # a speculative step: one token and three drafts
        handover.notice(bound)  # its catch-up is held back: the drafts may be taken back
        await _settle(handover)
        assert path.calls == [("replay", 0, 3)]
        old.replay.take_back(2)
        final[0] = True
        moved = await handover.take(bound, 0)  # the next step: the judged step's catch-up first, one short trip
        assert moved is not None and path.calls[-1] == ("extend", 3, 2) and routes.released == ["a"]

    asyncio.run(run())


def test_without_another_server_the_session_stays_on_the_leaving_one_until_one_appears():
    async def run() -> None:
        path, routes = Path({"a"}), Routes(missing=3)
        handover, bound = _setup(path, routes)
        _step(bound.states[0], 0, 4)
        handover.notice(bound)
        assert await handover.take(bound, 0) is None  # no route yet: the leaving server keeps serving
        await _settle(handover)
        assert len(routes.asked) == 4 and path.calls == [("replay", 0, 4)]
        assert await handover.take(bound, 1) is None  # an attempt already past hop 0 cannot move it
        assert await handover.take(bound, 0) is not None

    asyncio.run(run())


def test_a_hop_whose_server_stays_is_not_moved():
    async def run() -> None:
        path, routes = Path(set()), Routes()
        handover, bound = _setup(path, routes)
        _step(bound.states[0], 0, 4)
        handover.notice(bound)
        assert not handover.moves and await handover.take(bound, 0) is None and not routes.asked

    asyncio.run(run())
