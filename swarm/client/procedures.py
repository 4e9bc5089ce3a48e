"""The model's procedures beyond Hugging Face's forward and ``generate``, each a plan: scoring texts, extracting
hidden states, a fine-tuning step with its update phase, one step of an inference session; a pre-training step's
notice to the servers; and the client's own modules as the executor calls them.
A mixin of ``DistributedModelForCausalLM``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig

from swarm.client.adapters import ClientAdapters
from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context, Handler
from swarm.client.inference_session import InferenceSession
from swarm.client.runner import PlanRunner
from swarm.client.sequential import RemoteChain
from swarm.dht import dht_time
from swarm.errors import BadInputError
from swarm.families import local
from swarm.families.spec import Family
from swarm.hop import Hop
from swarm.identity import Signed
from swarm.protocol import StepNotice
from swarm.records import TrainerProgress


class Procedures:
    # what the model provides (declared for the type checker; transformers reads these annotations at run time)
    config: PretrainedConfig
    family: Family
    adapters: ClientAdapters | None
    _pretraining: tuple[int, int] | None
    model: Any  # transformers' modules: their attributes are untyped
    lm_head: Any

    if TYPE_CHECKING:  # defined by the model and transformers; declared here only, so nothing is overridden

        @property
        def runner(self) -> PlanRunner: ...

        @property
        def _session(self) -> InferenceSession | None: ...

        @property
        def blocks(self) -> RemoteChain: ...

        @property
        def prompt_tokens(self) -> int: ...

        @property
        def connection(self) -> SwarmConnection: ...

        def loss_function(self, *, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor: ...

    # ---- other procedures, as plans ---------------------------------------------------------------------------------
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's log-probability given the tokens before it (evaluation, reward models): [batch, n - 1],
        float32; 0 where the token is padding (``attention_mask`` 0)."""
        if self._session is not None:
            raise BadInputError("score runs outside an inference session")
        padded = attention_mask is not None and not bool(attention_mask.all())
        logp = self.runner.score(input_ids, Context(attention_mask if padded else None))
        if padded:
            assert attention_mask is not None
            logp = logp * attention_mask[:, 1:].to(logp.dtype)
        return logp

    def hidden_states(
        self, input_ids: torch.Tensor, block: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output of block ``block`` (0-based: Hugging Face's ``hidden_states[block + 1]``) for every token,
        [batch, n, hidden]: only blocks ``0..block`` are computed."""
        if self._session is not None:
            raise BadInputError("hidden_states runs outside an inference session")
        padded = attention_mask is not None and not bool(attention_mask.all())
        return self.runner.hidden_states(input_ids, block, Context(attention_mask if padded else None))

    def train_step(
        self,
        input_ids: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> float:
        """One fine-tuning step as its plan: forward keeping graphs, loss, backward through every server, then the
        plan's update phase (``optimizer`` steps and clears the gradients). Returns the loss."""
        call: Any = self  # the model's __call__ (torch's Module)
        labels = input_ids if labels is None else labels
        out = call(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        loss: torch.Tensor = out.loss
        # the backward phase: autograd, which hands the remote part to the chain's backward nodes
        torch.autograd.backward(loss)
        stepped: list[str] = []
        self.run_update({"optimizer_step": lambda node: stepped.append(_step(optimizer))})
        if not stepped:  # the call compiled into a plan without an update (it should not: it is a training step)
            raise BadInputError("this step's plan has no optimizer step; nothing was updated")
        return float(loss.item())

    def run_update(self, handlers: dict[str, Handler]) -> None:
        """The update phase of the last training plan (``optimizer_step``, ``average``), through ``handlers``."""
        self.runner.update(handlers)

    def pretraining(self, target_batch: int, average_every: int) -> None:
        """Mark this model as a pre-training trainer's: its training plans carry the global step's update."""
        self._pretraining = (target_batch, average_every)

    def notify_step(self, step: int, proof: Signed | None = None, wait: bool = True) -> None:
        """Pre-training: tell every server of the swarm that global step ``step`` has begun (best effort; a server
        that misses it takes the step at its next request or from the trainers' progress). The notice carries this
        client's progress at that step, signed with its key (``proof``, or signed here): a server acts only on a
        trainer of the run's word. ``wait=False``: sent while the caller goes on."""
        conn = self.connection
        if proof is None:
            progress = TrainerProgress(trainer=conn.peer_id, step=step, samples=0, updated=dht_time())
            proof = conn.store.sign(progress)
        conn.notify([Hop.of(r) for r in conn.view.servers()], StepNotice(step=step, proof=proof), wait=wait)

    def _session_step(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        new, full_mask, position_ids = session.history.unseen(input_ids, attention_mask, position_ids, session.position)
        return self._step_new(session, new, full_mask, position_ids)

    def _step_new(
        self,
        session: InferenceSession,
        new: torch.Tensor,
        full_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """A step of tokens ``new`` the session's servers have not seen, at the session's position."""
        first, prefix, batch = session.position == 0, session.history.prefix, new.shape[0]
        if prefix and not first:  # the prompts went in front of the first step (its plan's prompts node)
            ones = torch.ones(batch, prefix, dtype=torch.int64)
            full_mask = None if full_mask is None else torch.cat([ones, full_mask.to(torch.int64)], dim=1)
            position_ids = None if position_ids is None else position_ids + prefix
        if position_ids is None and self.family.spec.positions is not None and not prefix:
            # learned positions are added here, on the client: a step's positions continue from the session's
            start = session.position
            position_ids = torch.arange(start, start + new.shape[1]).unsqueeze(0).expand(batch, -1)
        padded = full_mask is not None and not bool(full_mask.all())
        ctx = Context(full_mask if padded else None, position_ids)
        logits = self.runner.session_step(session, new, ctx, prefix if first else 0)
        session.history.record(new)
        self.blocks.last_route = session.route  # what ``route`` shows once the session is over
        self.blocks.last_plan = session.plan
        return logits

    # ---- the client's own modules, for the executor ---------------------------------------------------------------
    def embed(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings, plus learned positions (GPT-2: ``position_ids``, by default ``past`` onwards); ``mask`` over
        every position of the session (None: no padding), for a family whose model counts positions along it."""
        return local.embed(self.family, self.model, ids, position_ids, past, mask)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return local.head(self.family, self.model, self.lm_head, hidden)  # final norm, head, logit soft-cap

    def prompt_vectors(self) -> torch.Tensor | None:
        return self.adapters.prompts if self.adapters is not None and self.prompt_tokens else None

    def causal_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return loss


def _step(optimizer: torch.optim.Optimizer) -> str:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return "stepped"
