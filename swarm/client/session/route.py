"""An inference session's route as one value: the ``generate`` plan, its schedule, the plan's ``span_step`` nodes in
chain order and each one's hop state. A repair computes a new value, which the session takes in one assignment once
the fresh hops hold their history: nothing is rolled back when they fail."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarm.client.executor import Schedule
from swarm.client.session.hop import HopState
from swarm.hop import Hop
from swarm.plan.ir import Plan, SpanStep


@dataclass(frozen=True)
class BoundRoute:
    plan: Plan
    schedule: Schedule | None  # None: worked out at the next step (a repaired plan's)
    ids: tuple[str, ...]  # the plan's span_step nodes, in chain order
    hops: Mapping[str, HopState]  # node -> its hop
    generation: int  # route generation: a chained hop given an older one is told this one

    @staticmethod
    def bind(plan: Plan, schedule: Schedule, route: list[Hop]) -> BoundRoute:
        ids = tuple(n.id for n in plan.order() if isinstance(n, SpanStep))
        return BoundRoute(plan, schedule, ids, {i: HopState(hop) for i, hop in zip(ids, route, strict=True)}, 0)

    @property
    def states(self) -> list[HopState]:
        return [self.hops[i] for i in self.ids]

    @property
    def route(self) -> list[Hop]:
        return [self.hops[i].hop for i in self.ids]

    def replaced(self, index: int, plan: Plan, ids: list[str], fresh: list[HopState], generation: int) -> BoundRoute:
        """This route with node ``index`` replaced by ``ids`` (the repaired ``plan``'s nodes), bound to ``fresh``."""
        hops = {i: s for i, s in self.hops.items() if i != self.ids[index]}
        hops.update(zip(ids, fresh, strict=True))
        order = self.ids[:index] + tuple(ids) + self.ids[index + 1 :]
        return BoundRoute(plan, None, order, hops, generation)

    def scheduled(self, schedule: Schedule) -> BoundRoute:
        return BoundRoute(self.plan, schedule, self.ids, self.hops, self.generation)
