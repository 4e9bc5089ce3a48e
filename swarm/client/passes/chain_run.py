"""One call's remote chain as it runs (``RemoteChain``'s and the chained passes' shared state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.hop import Hop
from swarm.plan.ir import Plan, SpanBackward, SpanForward
from swarm.protocol import TrainTag
from swarm.records import Capability
from swarm.rpc.remote import Tensors


@dataclass
class ChainRun:
    """One call's remote chain as it runs: the plan (repaired as servers fail), the hop each remote node is bound
    to, the forward nodes in chain order, and what each received (a recompute starts from it)."""

    plan: Plan
    hops: dict[str, Hop]
    aux: Tensors
    train: TrainTag | None
    needs: frozenset[Capability]
    forward_ids: list[str] = field(default_factory=list)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # node -> what it received (client dtype)
    server_ids: dict[str, str | None] = field(default_factory=dict)  # node -> the forward_id its server keeps
    failed: set[str] = field(default_factory=set)
    generation: int = 0

    def __post_init__(self) -> None:
        if not self.forward_ids:
            self.forward_ids = [n.id for n in self.plan.order() if isinstance(n, SpanForward)]

    @property
    def keep(self) -> bool:
        """The plan keeps graphs for a backward."""
        return any(isinstance(n, SpanBackward) for n in self.plan.nodes)

    def route(self) -> list[Hop]:
        return [self.hops[i] for i in self.forward_ids]

    def backward_ids(self, forward_ids: list[str]) -> list[str]:
        """The backward nodes of ``forward_ids``, in the order they run (reverse chain order)."""
        by_forward = {n.inputs[1]: n.id for n in self.plan.nodes if isinstance(n, SpanBackward)}
        return [by_forward[f] for f in reversed(forward_ids)]
