"""Two honest replicas of a stage in an averaging round, deterministically: the round's transport is replaced by what
hivemind's butterfly all-reduce does with a pair (each groupmate reduces one contiguous half of the flattened
tensors, weights then both Adam moments, with its own part as the pair's center), each part reduced by the real rule
(``centered_clip`` with the run's ``ClipRule``), and the result given to both. Both ways of splitting the halves run,
so no order of peers left to chance decides the outcome.

The case is the one that split two honest replicas for good (issue 54): a replica that joined at step 0 and saw no
micro-batch of step 1 (stepped on a zero gradient: both moments 0) averages with one that did. Reduced on their own,
the second moment's parts with the joiner's zeros as center came back 0 while the first moment's, reduced by the
other, kept half its value, and the next AdamW step divided it by ``sqrt(0) + eps``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from peers.training.span_trainer import SpanTrainer
from peers.training.state_parts import STATE_PARTS
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.model_files import new_model
from swarm.training.averaging import round_slack
from swarm.training.init import block_prefix, init_module
from swarm.training.optim import moment_ratio, moments_hold
from swarm.training.robust import ClipRule, centered_clip
from swarm.training.run import RunConfig, load_run

SHIPPED = Path(__file__).parents[2] / "configs" / "runs" / "tiny-llama.toml"
STAGE = Span(0, 2)


def replica(folder: Path, run: RunConfig) -> SpanTrainer:
    """A replica of the stage, from the run's seeded initial weights (the same on every replica)."""
    model = new_model(run.hf_config(), torch.float32)
    layers = torch.nn.ModuleList(model.model.layers[STAGE.start : STAGE.end])
    for i, layer in enumerate(layers):
        init_module(layer, block_prefix(model.config, STAGE.start + i), model.config, run.seed)
    return SpanTrainer(run, layers, STAGE, folder)


def step(trainer: SpanTrainer, seed: int | None, samples: int = 16) -> None:
    """One global step: on a seeded gradient for ``samples`` samples, or (``seed`` None) on none."""
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for p in trainer.params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2 * samples
        trainer.samples = samples
    trainer.apply_step()


def pair_round(a: SpanTrainer, b: SpanTrainer, a_first: bool) -> list[torch.Tensor]:
    """The values a pair's round gives both: the flattened tensors split in two halves, the first reduced by ``a``
    (``a_first``) or ``b`` with its own part as center."""
    rule = ClipRule.for_weights(len(a.params), len(a.tensors()), round_slack(a.run))
    total = sum(t.numel() for t in a.tensors())
    out, offset = [], 0
    for k, (x, y) in enumerate(zip(a.tensors(), b.tensors(), strict=True)):
        fx, fy, reduced = x.flatten(), y.flatten(), torch.empty(x.numel())
        cut = min(max(total // 2 - offset, 0), x.numel())  # where this tensor crosses into the second half
        for lo, hi, first in ((0, cut, True), (cut, x.numel(), False)):
            if hi > lo:
                own = 0 if first == a_first else 1
                reduced[lo:hi], _ = centered_clip([fx[lo:hi], fy[lo:hi]], own, rule.bound(k), rule.spread)
        out.append(reduced.view_as(x))
        offset += x.numel()
    return out


class Delivered:
    """The averager's part the trainer sees: it allows groupmates and writes a round's values into the tensors."""

    def __init__(self, trainer: SpanTrainer, values: list[torch.Tensor]) -> None:
        self.trainer, self.values = trainer, values

    def allow(self, peers: object) -> None:
        pass

    def average_round(self, run: RunConfig, what: str) -> bool:
        with torch.no_grad():
            for t, v in zip(self.trainer.tensors(), self.values, strict=True):
                t.copy_(v)
        return True


def average(a: SpanTrainer, b: SpanTrainer, a_first: bool) -> None:
    values = pair_round(a, b, a_first)
    for t in (a, b):
        t.averager, t.replicas = Delivered(t, values), 2  # type: ignore[assignment]
        t.average()
        t.averager = None


@pytest.mark.parametrize("joiner_reduces_first", [False, True])
def test_a_replica_with_no_moments_yet_and_one_that_stepped_stay_together(tmp_path, joiner_reduces_first):
    run = dataclasses.replace(load_run(SHIPPED), average_every=1)
    honest, joiner = replica(tmp_path / "a", run), replica(tmp_path / "b", run)
    step(honest, seed=1)  # saw step 1's whole batch
    step(joiner, seed=None)  # joined at step 0, saw none of step 1: both its moments are 0
    assert all(float(t.abs().max()) == 0 for t in joiner.tensors()[len(joiner.params) :])
    average(honest, joiner, a_first=not joiner_reduces_first)
    for x, y in zip(honest.tensors(), joiner.tensors(), strict=True):
        assert torch.equal(x, y)  # the round left them equal
    n = len(honest.params)
    held = moments_hold(honest.tensors()[n : 2 * n], honest.tensors()[2 * n :], run.betas)  # after the round
    lr = run.lr * run.lr_factor(1)
    for seed, t in ((2, honest), (None, joiner)):
        before = [p.detach().clone() for p in t.params]
        step(t, seed)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(t.params, before, strict=True))
        assert moved <= 3 * lr, moved  # an AdamW step, not a division by eps (it moved weights by ~1e3 here)
    assert held
    average(honest, joiner, a_first=joiner_reduces_first)  # the next round is kept on both: they agree
    for x, y in zip(honest.tensors(), joiner.tensors(), strict=True):
        assert torch.equal(x, y)
    assert honest.health.undone == joiner.health.undone == 0 and honest.health.wanted is None


def test_adams_own_states_hold_the_moment_bound():
    """The bound the round holds moments to is one every AdamW state meets, whatever its gradients (so holding them
    changes nothing in an honest state, and a state copy that breaks it cannot be an AdamW's)."""
    gen = torch.Generator().manual_seed(0)
    for betas in ((0.9, 0.95), (0.9, 0.999), (0.5, 0.6)):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = torch.optim.AdamW([p], lr=1e-3, betas=betas)
        for t in range(200):
            sign = torch.sign(torch.randn(4096, generator=gen))  # runs of one sign push m toward its bound
            p.grad = sign * (3.0 if t % 5 == 0 else 0.0) + torch.randn(4096, generator=gen) * 1e-3 * (t % 3)
            opt.step()
            s = opt.state[p]
            assert moments_hold([s["exp_avg"]], [s["exp_avg_sq"]], betas), (betas, t)
    assert moment_ratio((0.9, 0.8)) is None  # b1^2 >= b2: no bound exists


def test_a_state_copy_whose_moments_no_adamw_holds_is_refused(tmp_path):
    run = dataclasses.replace(load_run(SHIPPED), average_every=1)
    source, taker = replica(tmp_path / "a", run), replica(tmp_path / "b", run)
    step(source, seed=1)
    state = source.export_state()
    name = next(k for k in state if k.startswith(STATE_PARTS[2]))
    state[name] = torch.zeros_like(state[name])  # a second moment gone where the first is not
    with pytest.raises(BadInputError, match="moments"):
        taker.import_state(1, state)
    assert taker.step == 0


def test_honest_adamw_steps_stay_within_reach_of_the_anchor_and_a_corrupted_weight_does_not(tmp_path):
    """The drift check never flags a replica that only took AdamW steps (gradients of any scale, zero-gradient steps,
    the warm-up and the schedule), and flags one whose weights moved beyond them."""
    run = dataclasses.replace(load_run(SHIPPED), average_every=1)
    t = replica(tmp_path, run)
    gen = torch.Generator().manual_seed(3)
    for k in range(40):
        if k % 4 == 3:
            step(t, seed=None)  # a step without micro-batches
        else:
            for p in t.params:  # gradients from tiny to huge, with runs of one sign (Adam's largest steps)
                p.grad = torch.sign(torch.randn(p.shape, generator=gen)) * 10.0 ** float(k % 7 - 3)
            t.samples = 1
            t.apply_step()
        assert t.health.drift(t.step, t.params) is None, k
    reach = t.health.reach(t.step)  # 40 steps from the initial weights, warm-up included
    assert reach < 0.5
    with torch.no_grad():
        t.params[3].view(-1)[7] = t.health.anchor[3].view(-1)[7] + reach * 1.02 + 1e-4
    assert "weight tensor 3 moved" in (t.health.drift(t.step, t.params) or "")


def test_who_takes_a_copy(tmp_path):
    """A replica that is off asks at once and sits out rounds; one that looks sound asks only a majority, after three
    rounds in a row undone; a kept round ends both."""
    run = dataclasses.replace(load_run(SHIPPED), average_every=1)
    t = replica(tmp_path, run)
    step(t, seed=1)
    tensors = t.tensors()
    far = [x + 1.0 for x in tensors]  # a result that moves every weight far: implausible, undone
    for k in range(3):
        before = [x.clone() for x in tensors]
        with torch.no_grad():
            for x, f in zip(tensors, far, strict=True):
                x.copy_(f)
        assert not t.health.settle(t.step, tensors, before)
        assert all(torch.equal(x, b) for x, b in zip(tensors, before, strict=True))  # undone
        wanted = t.health.wanted
        assert (wanted is None) if k < 2 else (wanted is not None and wanted.majority_only and not t.health.off)
    before = [x.clone() for x in tensors]
    assert t.health.settle(t.step, tensors, before)  # a round that changed nothing is kept: no copy wanted
    assert t.health.wanted is None and t.health.undone == 0
    with torch.no_grad():
        t.params[0].add_(0.5)  # off by itself
    assert t.health.check(t.step, t.params)
    assert t.health.off and t.health.wanted is not None and not t.health.wanted.majority_only
    t.averager, t.replicas = Delivered(t, far), 2  # type: ignore[assignment]
    t.average()  # sits out: nothing delivered
    assert not torch.equal(t.tensors()[0], far[0])
    state = replica(tmp_path / "other", run).export_state()
    t.heal(0, state)
    assert t.health.heals == 1 and not t.health.off and t.health.wanted is None
