"""What the model does, as plans: every call routes (when it needs a route), compiles the plan of its procedure
once per route, and runs it through the executor. Forward and loss, a fine-tuning or pre-training step, an
inference step, scoring texts and extracting hidden states differ only in the plan.

The client's own ops (embeddings, trainable prompts, final norm and head, loss) are the model's modules
(``ModelOps``); the remote part is the ``RemoteChain`` or the inference session, preceded by the client's local
blocks where it runs some (``swarm.client.local_blocks``: the routes then start after them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

import torch

from swarm.client.coalesce import Coalescer
from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context, Executor, Handler, PlanCache, Schedule, Tensors
from swarm.client.local_blocks import LocalBlocks
from swarm.client.passes.chain_run import ChainRun
from swarm.client.passes.sequential import RemoteChain, aux_tensors
from swarm.client.session.inference_session import InferenceSession
from swarm.errors import BadInputError, MissingBlocksError
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, finetune_plan, forward_plan, hidden_plan, pretrain_plan, score_plan
from swarm.plan.ir import Plan, SpanBackward, SpanForward, Task
from swarm.protocol import TrainTag
from swarm.records import Capability


class ModelParts(Protocol):
    """What the runner uses of the model: its local modules and trainable prompts."""

    def embed(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def prompt_vectors(self) -> torch.Tensor | None: ...

    def causal_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...


Aux = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def with_prompts(
    prompts: torch.Tensor, embeds: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> Aux:
    """Prepend the trainable prompts as PEFT's prompt tuning does: attended by every token."""
    n, batch = prompts.shape[0], embeds.shape[0]
    embeds = torch.cat([prompts.to(embeds.dtype).unsqueeze(0).expand(batch, -1, -1), embeds], dim=1)
    if attention_mask is not None:
        ones = torch.ones(batch, n, dtype=attention_mask.dtype, device=attention_mask.device)
        attention_mask = torch.cat([ones, attention_mask], dim=1)
    if position_ids is not None:
        position_ids = torch.cat([torch.arange(n).expand(batch, -1), position_ids + n], dim=1)
    return embeds, attention_mask, position_ids


class ModelOps:
    """The executor's client ops, by the model's modules."""

    def __init__(self, parts: ModelParts) -> None:
        self.parts = parts
        self._head = Coalescer(parts.head)  # concurrent decode steps (the API's requests) share one head call

    def embed(self, ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.parts.embed(ids, ctx.positions, ctx.past, ctx.mask)

    def prompts(self, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        vectors = self.parts.prompt_vectors()
        if vectors is None:
            raise BadInputError("this model has no trainable prompts")
        hidden, ctx.mask, ctx.positions = with_prompts(vectors, hidden, ctx.mask, ctx.positions)
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, prompts: int) -> torch.Tensor:
        if prompts:  # the prompt positions predict nothing, the last of them the first token
            pad = torch.full((labels.shape[0], prompts), -100, dtype=labels.dtype, device=labels.device)
            labels = torch.cat([pad, labels], dim=1)
        return self.parts.causal_loss(logits, labels)


def tokens_of(inputs: Mapping[str, torch.Tensor]) -> int:
    """Tokens in a call (routing prices a hop's bytes for them): its ids', or its embeddings' positions."""
    if "input_ids" in inputs:
        return int(inputs["input_ids"].numel())
    if "inputs_embeds" in inputs:
        return int(inputs["inputs_embeds"].shape[:-1].numel())
    return 1


def bind(plan: Plan, route: list[Hop], aux: Tensors, train: TrainTag | None, needs: frozenset[Capability]) -> ChainRun:
    """A forward plan's remote nodes bound to ``route``: its forward nodes in chain order, each backward node to the
    server of its forward."""
    forwards = [n.id for n in plan.order() if isinstance(n, SpanForward)]
    hops = dict(zip(forwards, route, strict=True))
    for n in plan.nodes:
        if isinstance(n, SpanBackward):
            hops[n.id] = hops[n.inputs[1]]
    return ChainRun(plan, hops, aux, train, needs, forward_ids=forwards)


class PlanRunner:
    def __init__(
        self,
        parts: ModelParts,
        conn: SwarmConnection,
        chain: RemoteChain,
        shape: ModelShape,
        local: LocalBlocks | None = None,
    ) -> None:
        self.conn, self.chain, self.shape = conn, chain, shape
        self.local = local  # the first blocks, run here before the remote part (None: every block is remote)
        self.plans = PlanCache()
        self.executor = Executor(ModelOps(parts))
        self.last: tuple[Plan, Schedule] | None = None  # the last plan run (its update phase runs after backward)

    def needs(self, keep: bool, inference: bool = False) -> frozenset[Capability]:
        needs = {Capability.INFERENCE if inference else Capability.FORWARD}
        if keep:
            needs.add(Capability.BACKWARD)
        if self.chain.delivery is not None:
            needs.add(Capability.ADAPTERS)
        return frozenset(needs)

    def route(self, end: int, needs: frozenset[Capability], stochastic: bool = False, tokens: int = 1) -> list[Hop]:
        """A route over blocks ``0:end`` (after the local blocks: ``SwarmView.route``) for calls of ``tokens``
        tokens (waiting, within the retry budget, for blocks nobody serves yet)."""
        view = self.conn.view
        route: list[Hop] = self.conn.retrier.run(
            lambda: view.route(0, end, mode="forward", stochastic=stochastic, needs=needs, tokens=tokens), "route"
        )
        return route

    def _run(
        self,
        plan: Plan,
        sched: Schedule,
        route: list[Hop],
        inputs: Mapping[str, torch.Tensor],
        ctx: Context,
        needs: frozenset[Capability],
    ) -> Tensors:
        def segment(plan: Plan, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
            if self.local is not None:
                hidden = self.local(hidden, ctx.mask, ctx.positions)
            run = bind(plan, route, aux_tensors(ctx.mask, ctx.positions), ctx.train, needs)
            return self.chain.run(run, hidden)

        self.last = plan, sched
        return self.executor.run(plan, sched, inputs, ctx, segment)

    # ---- procedures ---------------------------------------------------------------------------------------------
    def forward(
        self,
        inputs: Mapping[str, torch.Tensor],
        ctx: Context,
        *,
        keep: bool,
        prompts: int,
        task: Task = "forward",
        target_batch: int = 1,
        average_every: int = 0,
        params: Literal["adapter", "client"] = "adapter",
    ) -> Tensors:
        """Logits (and loss, given ``labels``); ``keep``: graphs kept for a backward (a training step: ``task``
        finetune or pretrain adds its update phase)."""
        needs = self.needs(keep)
        found: list[Hop] = []
        if keep and ctx.train is None and self.chain.delivery is None:
            # a plain forward under grad mode (a user who did not say no_grad, or one who will backpropagate): where
            # only servers without a backward hold some blocks, run it there, and let a backward fail clearly
            keep, needs, found = self._backward_or_not(needs, tokens_of(inputs))
        tokens = tokens_of(inputs)
        route = found or self.route(self.shape.num_blocks, needs, stochastic=ctx.train is not None, tokens=tokens)
        labels, embeds = "labels" in inputs, "inputs_embeds" in inputs
        key = (task, tuple(route), prompts, labels, keep, embeds, target_batch, average_every, params)

        def build() -> Plan:
            if task == "finetune" and keep and labels and not embeds:
                return finetune_plan(self.shape, route, prompts=prompts, params=params)
            if task == "pretrain" and keep and labels and not embeds and not prompts:
                return pretrain_plan(self.shape, route, target_batch=target_batch, average_every=average_every)
            return forward_plan(self.shape, route, prompts=prompts, labels=labels, keep=keep, embeds=embeds)

        plan, sched = self.plans.get(key, build)
        return self._run(plan, sched, route, inputs, ctx, needs)

    def _backward_or_not(
        self, needs: frozenset[Capability], tokens: int
    ) -> tuple[bool, frozenset[Capability], list[Hop]]:
        """Keep graphs or not, what the route needs then, and the route found (empty: route as any call does)."""
        view, end = self.conn.view, self.shape.num_blocks
        try:
            return True, needs, view.route(0, end, mode="forward", needs=needs, tokens=tokens)
        except MissingBlocksError:
            forward_only = self.needs(False)
            try:
                return False, forward_only, view.route(0, end, mode="forward", needs=forward_only, tokens=tokens)
            except MissingBlocksError:
                return True, needs, []  # blocks are missing either way: wait for them as any call does

    def score(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        needs = self.needs(False)
        route = self.route(self.shape.num_blocks, needs, tokens=input_ids.numel())
        plan, sched = self.plans.get(("score", tuple(route)), lambda: score_plan(self.shape, route))
        return self._run(plan, sched, route, {"input_ids": input_ids}, ctx, needs)["logprobs"]

    def hidden_states(self, input_ids: torch.Tensor, block: int, ctx: Context) -> torch.Tensor:
        if not 0 <= block < self.shape.num_blocks:
            raise BadInputError(f"block {block} of a {self.shape.num_blocks}-block model")
        if self.local is not None and block < self.local.count:
            raise BadInputError(f"block {block} runs on this client (local_blocks={self.local.count}), not the swarm")
        needs = self.needs(False)
        route = self.route(block + 1, needs, tokens=input_ids.numel())
        plan, sched = self.plans.get(("hidden", tuple(route)), lambda: hidden_plan(self.shape, route))
        return self._run(plan, sched, route, {"input_ids": input_ids}, ctx, needs)["hidden"]

    def session_step(
        self, session: InferenceSession, input_ids: torch.Tensor, ctx: Context, prompts: int
    ) -> torch.Tensor:
        plan, sched = session.plan_for(prompts)
        ctx.past = session.position  # every caller's step continues the session's positions (the API's too)
        segment = session.segment
        local = self.local
        if local is not None:

            def segment(plan: Plan, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
                def remote(h: torch.Tensor) -> torch.Tensor:
                    return session.segment(plan, h, ctx)

                return local.step(session, hidden, ctx.mask, ctx.positions, ctx.past, session.max_length, remote)

        return self.executor.run(plan, sched, {"input_ids": input_ids}, ctx, segment)["logits"]

    def update(self, handlers: Mapping[str, Handler]) -> None:
        """The update phase of the last plan run (a training step's), through the training loop's handlers."""
        if self.last is None:
            raise BadInputError("no training step has run")
        self.executor.update(self.last[1], handlers)
