"""One executor for every plan: the model's forward, ``generate``'s steps, fine-tuning and pre-training steps,
scoring and hidden-state extraction all run here, node by node.

A plan's forward phase runs in the plan's order: client ops through the model's own modules (``LocalOps``), and the
remote part (the transfers and remote nodes between the client's ops) through a ``Segment``: the ``RemoteChain``
for ``span_forward`` plans (differentiable, repaired on failure), the inference session for ``span_step`` plans.
The backward phase is torch autograd's: from the loss it reaches the remote part, whose ``span_backward`` nodes the
chain runs, and goes on into the client's own parameters (the ``local_backward`` nodes). The update phase runs its
nodes (``optimizer_step``, ``average``) through handlers the training loop gives.

What the executor works out of a plan (which node runs how, where the remote part starts and ends) is worked out
once per plan and cached with it, and plans are compiled once per route (``PlanCache``): a decode step costs a walk
over a handful of nodes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from swarm.errors import BadInputError
from swarm.plan.ir import REMOTE_OPS, AnyNode, Head, Input, LogProbs, Loss, Output, Plan, Prompts, Transfer
from swarm.protocol import TrainTag

Tensors = dict[str, torch.Tensor]


@dataclass
class Context:
    """What travels beside the hidden states of one call: the attention mask over every position (None: no
    padding), explicit positions, and a pre-training trainer's tag."""

    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    train: TrainTag | None = None
    past: int = 0  # tokens of the session cached before this call (where positions continue from)
    # the head on the last position only: a decode loop reads no other, and over a long prompt the head's matrix
    # (SmolLM2's: 576 x 49152) costs more than the blocks' share of some steps
    last_only: bool = False


class LocalOps(Protocol):
    """The client's own modules, by op."""

    def embed(self, ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        """What enters the first block (``ctx``'s positions: for families with learned positions)."""

    def prompts(self, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Put the trainable prompts in front (and extend ``ctx``'s mask and positions over them)."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, prompts: int) -> torch.Tensor: ...


# Runs a plan's remote part: from the hidden states its first transfer reads to those its last hands back.
Segment = Callable[[Plan, torch.Tensor, Context], torch.Tensor]
Handler = Callable[[AnyNode], None]


@dataclass(frozen=True)
class Schedule:
    """How the executor walks one plan's forward phase: client nodes, with the remote part as one step."""

    steps: tuple[AnyNode | None, ...]  # None: the remote part
    source: str  # what the remote part reads
    sink: str  # what it hands back
    update: tuple[AnyNode, ...]


def schedule(plan: Plan) -> Schedule:
    steps: list[AnyNode | None] = []
    remote = False
    source = sink = ""
    for node in plan.phase("forward"):
        if isinstance(node, Transfer) or node.op in REMOTE_OPS:
            if not remote:
                remote, source = True, node.inputs[0]
                steps.append(None)
            sink = node.id
            continue
        steps.append(node)
    if not remote:
        raise BadInputError(f"a {plan.task} plan with no remote part")
    return Schedule(tuple(steps), source, sink, tuple(plan.phase("update")))


class PlanCache:
    """Plans compiled once per key (task, route, shapes), with their schedules; the least recently used go."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._plans: OrderedDict[Hashable, tuple[Plan, Schedule]] = OrderedDict()
        self._lock = threading.Lock()  # pre-training runs micro-batches from several threads
        self.compiled = 0  # how many plans were compiled (tests and benchmarks read it)

    def get(self, key: Hashable, build: Callable[[], Plan]) -> tuple[Plan, Schedule]:
        with self._lock:
            hit = self._plans.get(key)
            if hit is not None:
                self._plans.move_to_end(key)
                return hit
        plan = build()
        entry = plan, schedule(plan)
        with self._lock:
            self.compiled += 1
            self._plans[key] = entry
            if len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return entry


class Executor:
    def __init__(self, local: LocalOps) -> None:
        self.local = local

    def run(
        self, plan: Plan, sched: Schedule, inputs: Mapping[str, torch.Tensor], ctx: Context, segment: Segment
    ) -> Tensors:
        """The forward phase of ``plan``: its outputs by name."""
        values: Tensors = {}
        outputs: Tensors = {}
        local = self.local
        for node in sched.steps:
            if node is None:
                values[sched.sink] = segment(plan, values[sched.source], ctx)
            elif isinstance(node, Input):
                value = inputs.get(node.id)
                if value is None:
                    raise BadInputError(f"the {plan.task} plan needs {node.id}")
                values[node.id] = value
            elif node.op == "embed":
                values[node.id] = local.embed(values[node.inputs[0]], ctx)
            elif isinstance(node, Prompts):
                values[node.id] = local.prompts(values[node.inputs[0]], ctx)
            elif isinstance(node, Head):
                hidden = values[node.inputs[0]]
                values[node.id] = local.head(hidden[:, -1:] if ctx.last_only else hidden)
            elif isinstance(node, Loss):
                values[node.id] = local.loss(values[node.inputs[0]], values[node.inputs[1]], node.prompts)
            elif isinstance(node, LogProbs):
                values[node.id] = logprobs(values[node.inputs[0]], values[node.inputs[1]])
            elif isinstance(node, Output):
                value = values[node.inputs[0]]
                outputs[node.name] = value[:, node.skip :] if node.skip and not ctx.last_only else value
            else:  # a client op the forward phase has no handler for: the plan is not one this side runs
                raise BadInputError(f"node {node.id}: op {node.op} does not run in the forward phase")
        return outputs

    def update(self, sched: Schedule, handlers: Mapping[str, Handler]) -> None:
        """The update phase: each node through the handler of its op."""
        for node in sched.update:
            handler = handlers.get(node.op)
            if handler is None:
                raise BadInputError(f"node {node.id}: nobody here runs {node.op}")
            handler(node)


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens before t) for t = 1 .. n-1, in float32: [batch, n - 1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None].to(torch.int64)).squeeze(-1)
