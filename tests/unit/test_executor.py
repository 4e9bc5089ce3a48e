"""The plan executor on real plans and real torch modules, with the remote part replaced by a local function (the
remote part itself is tested against real servers in tests/integration)."""

from __future__ import annotations

import pytest
import torch

from swarm.client.executor import Context, Executor, PlanCache, logprobs, schedule
from swarm.client.runner import ModelOps, with_prompts
from swarm.errors import BadInputError
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, finetune_plan, forward_plan, generate_plan, pretrain_plan, score_plan
from swarm.plan.ir import Plan

SHAPE = ModelShape("m", 4, 8, 11)
ROUTE = [Hop("peerA", 0, 2, dtype="float16"), Hop("peerB", 2, 4)]


class Parts:
    def __init__(self, prompts: int = 0) -> None:
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(SHAPE.vocab_size, SHAPE.hidden_size)
        self.lm_head = torch.nn.Linear(SHAPE.hidden_size, SHAPE.vocab_size, bias=False)
        self.vectors = torch.randn(prompts, SHAPE.hidden_size) if prompts else None

    def embed(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.embed_tokens(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def prompt_vectors(self) -> torch.Tensor | None:
        return self.vectors

    def causal_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def remote(plan: Plan, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Stands in for the servers: a fixed function of the hidden states (and it sees the context they travel with)."""
    remote.seen = ctx  # type: ignore[attr-defined]
    return torch.tanh(hidden) * 2


def test_schedule_runs_the_remote_part_as_one_step():
    sched = schedule(forward_plan(SHAPE, ROUTE, labels=True, keep=True))
    steps = [s.id if s is not None else None for s in sched.steps]
    assert steps == ["input_ids", "embed", None, "head", "logits", "labels", "loss", "loss_out"]
    assert (sched.source, sched.sink) == ("embed", "hidden")
    assert not sched.update
    assert [n.op for n in schedule(pretrain_plan(SHAPE, ROUTE, target_batch=8, average_every=2)).update] == [
        "optimizer_step",
        "average",
    ]


def test_forward_with_loss_equals_the_modules_called_directly():
    parts = Parts()
    ids = torch.randint(0, SHAPE.vocab_size, (2, 5))
    plan = forward_plan(SHAPE, ROUTE, labels=True)
    out = Executor(ModelOps(parts)).run(plan, schedule(plan), {"input_ids": ids, "labels": ids}, Context(), remote)
    logits = parts.head(torch.tanh(parts.embed(ids)) * 2)
    assert torch.equal(out["logits"], logits)
    assert torch.equal(out["loss"], parts.causal_loss(logits, ids))


def test_prompts_extend_the_context_and_are_dropped_from_the_logits():
    parts = Parts(prompts=3)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    plan = forward_plan(SHAPE, ROUTE, prompts=3, labels=True)
    ctx = Context(mask=mask, positions=torch.arange(5).expand(2, -1))
    out = Executor(ModelOps(parts)).run(plan, schedule(plan), {"input_ids": ids, "labels": ids}, ctx, remote)
    assert out["logits"].shape == (2, 5, SHAPE.vocab_size)
    assert remote.seen.mask.shape == (2, 8) and remote.seen.positions[0].tolist() == list(range(8))  # type: ignore[attr-defined]
    assert parts.vectors is not None
    embeds, _, _ = with_prompts(parts.vectors, parts.embed(ids), None, None)
    full = parts.head(torch.tanh(embeds) * 2)
    assert torch.equal(out["logits"], full[:, 3:])
    labels = torch.cat([torch.full((2, 3), -100), ids], dim=1)  # the last prompt position predicts the first token
    assert torch.equal(
        out["loss"], torch.nn.functional.cross_entropy(full[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    )


def test_score_is_each_tokens_log_probability():
    parts = Parts()
    ids = torch.randint(0, SHAPE.vocab_size, (3, 6))
    plan = score_plan(SHAPE, ROUTE)
    out = Executor(ModelOps(parts)).run(plan, schedule(plan), {"input_ids": ids}, Context(), remote)["logprobs"]
    logits = parts.head(torch.tanh(parts.embed(ids)) * 2)
    for b in range(3):
        for t in range(5):
            expected = torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]]
            assert torch.allclose(out[b, t], expected, atol=1e-6)
    assert torch.equal(out, logprobs(logits, ids))


def test_a_plan_missing_an_input_or_a_handler_is_a_clear_error():
    parts = Parts()
    plan = forward_plan(SHAPE, ROUTE, labels=True)
    with pytest.raises(BadInputError, match="needs labels"):
        Executor(ModelOps(parts)).run(
            plan, schedule(plan), {"input_ids": torch.ones(1, 2, dtype=torch.long)}, Context(), remote
        )
    sched = schedule(finetune_plan(SHAPE, ROUTE))
    with pytest.raises(BadInputError, match="nobody here runs optimizer_step"):
        Executor(ModelOps(parts)).update(sched, {})
    ran: list[str] = []
    Executor(ModelOps(parts)).update(sched, {"optimizer_step": lambda node: ran.append(node.id)})
    assert ran == ["optimizer"]


def test_plans_are_compiled_once_per_key_and_the_oldest_go():
    cache = PlanCache(size=2)
    builds = []

    def build(route: list[Hop]) -> Plan:
        builds.append(route)
        return generate_plan(SHAPE, route, max_length=16)

    first = cache.get("a", lambda: build(ROUTE))
    assert cache.get("a", lambda: build(ROUTE)) is first and cache.compiled == 1
    cache.get("b", lambda: build(ROUTE))
    cache.get("c", lambda: build(ROUTE))
    cache.get("a", lambda: build(ROUTE))  # evicted by b and c: compiled again
    assert cache.compiled == 4 and len(builds) == 4
