"""The model's procedures, each a plan that ``PlanRunner`` routes, compiles and runs: a forward (with a fine-tuning
or pre-training step's update phase), scoring texts, extracting hidden states, one step of an inference session;
and a pre-training step's notice to the servers. Held by ``DistributedModelForCausalLM``, which keeps only what
Hugging Face's API asks of it (its modules, ``forward``, ``generate``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

from swarm.client.executor import Context, Handler, Tensors
from swarm.client.generation import OpenSessions
from swarm.client.runner import PlanRunner
from swarm.client.session.inference_session import InferenceSession
from swarm.dht import dht_time
from swarm.errors import BadInputError
from swarm.hop import Hop
from swarm.identity import Signed
from swarm.plan.ir import Task
from swarm.protocol import StepNotice
from swarm.records import TrainerProgress


class Procedures:
    def __init__(self, runner: PlanRunner, sessions: OpenSessions, learned_positions: bool) -> None:
        """``learned_positions``: the family adds learned positions on the client (GPT-2), which a session's steps
        continue from the session's position."""
        self.runner, self.sessions = runner, sessions
        self.learned_positions = learned_positions
        self.pretraining: tuple[int, int] | None = None  # a pre-training trainer's (target batch, average every)

    def forward(
        self,
        inputs: Mapping[str, torch.Tensor],
        ctx: Context,
        *,
        keep: bool,
        prompts: int,
        params: Literal["adapter", "client"],
    ) -> Tensors:
        """Logits (and loss, given ``labels``); ``keep``: graphs kept for a backward: a pre-training step when
        ``ctx`` carries a training tag, a fine-tuning step given labels, each with its plan's update phase."""
        task: Task = "forward"
        if keep and ctx.train is not None:
            task = "pretrain"
        elif keep and "labels" in inputs:
            task = "finetune"
        target, every = self.pretraining or (1, 0)
        return self.runner.forward(
            inputs,
            ctx,
            keep=keep,
            prompts=prompts,
            task=task,
            target_batch=target,
            average_every=every,
            params=params,
        )

    def _outside_session(self, name: str) -> None:
        if self.sessions.current is not None:
            raise BadInputError(f"{name} runs outside an inference session")

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's log-probability given the tokens before it: [batch, n - 1], float32; 0 where the token is
        padding (``attention_mask`` 0)."""
        self._outside_session("score")
        padded = attention_mask is not None and not bool(attention_mask.all())
        logp = self.runner.score(input_ids, Context(attention_mask if padded else None))
        if padded:
            assert attention_mask is not None
            logp = logp * attention_mask[:, 1:].to(logp.dtype)
        return logp

    def hidden_states(
        self, input_ids: torch.Tensor, block: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output of block ``block`` for every token, [batch, n, hidden]: only blocks ``0..block`` run."""
        self._outside_session("hidden_states")
        padded = attention_mask is not None and not bool(attention_mask.all())
        return self.runner.hidden_states(input_ids, block, Context(attention_mask if padded else None))

    def train_step(self, loss_of: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> float:
        """One fine-tuning step as its plan: ``loss_of`` runs the forward keeping graphs, then the backward through
        every server, then the plan's update phase (``optimizer`` steps and clears the gradients)."""
        loss = loss_of()
        # the backward phase: autograd, which hands the remote part to the chain's backward nodes
        torch.autograd.backward(loss)
        stepped: list[str] = []
        self.update({"optimizer_step": lambda node: stepped.append(_step(optimizer))})
        if not stepped:  # the call compiled into a plan without an update (it should not: it is a training step)
            raise BadInputError("this step's plan has no optimizer step; nothing was updated")
        return float(loss.item())

    def update(self, handlers: Mapping[str, Handler]) -> None:
        """The update phase of the last training plan (``optimizer_step``, ``average``), through ``handlers``."""
        self.runner.update(handlers)

    def notify_step(self, step: int, proof: Signed | None = None, wait: bool = True) -> None:
        """Pre-training: tell every server that global step ``step`` has begun (best effort), with this client's
        progress at that step, signed with its key (``proof``, or signed here). The servers this client banned hear it
        too: a stage set aside for refusing a step it was behind on would otherwise stay behind, and refuse again."""
        conn = self.runner.conn
        if proof is None:
            progress = TrainerProgress(trainer=conn.peer_id, step=step, samples=0, updated=dht_time())
            proof = conn.store.sign(progress)
        hops = [Hop.of(r) for r in conn.view.servers(with_banned=True)]
        conn.notify(hops, StepNotice(step=step, proof=proof), wait=wait)

    # ---- an inference session's step -------------------------------------------------------------------------------
    def session_step(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """A step given whole sequences (as ``generate`` passes them): only the tokens the servers have not seen go."""
        new, full_mask, position_ids = session.history.unseen(input_ids, attention_mask, position_ids, session.position)
        return self.step_new(session, new, full_mask, position_ids)

    def step_new(
        self,
        session: InferenceSession,
        new: torch.Tensor,
        full_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A step of tokens ``new`` the session's servers have not seen, at the session's position."""
        first, prefix, batch = session.position == 0, session.history.prefix, new.shape[0]
        if prefix and not first:  # the prompts went in front of the first step (its plan's prompts node)
            ones = torch.ones(batch, prefix, dtype=torch.int64)
            full_mask = None if full_mask is None else torch.cat([ones, full_mask.to(torch.int64)], dim=1)
            position_ids = None if position_ids is None else position_ids + prefix
        if position_ids is None and self.learned_positions and not prefix:
            # learned positions are added here, on the client: a step's positions continue from the session's
            start = session.position
            position_ids = torch.arange(start, start + new.shape[1]).unsqueeze(0).expand(batch, -1)
        padded = full_mask is not None and not bool(full_mask.all())
        ctx = Context(full_mask if padded else None, position_ids)
        logits = self.runner.session_step(session, new, ctx, prefix if first else 0)
        session.history.record(new)
        self.runner.chain.last_route = session.route  # what the model's ``route`` shows once the session is over
        self.runner.chain.last_plan = session.plan
        return logits


def _step(optimizer: torch.optim.Optimizer) -> str:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return "stepped"
