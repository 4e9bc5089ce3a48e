"""The one optimizer of a pre-training run, as every party builds it: AdamW with the run's settings, its learning
rate following the run's schedule of the global step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from swarm.training.run import RunConfig


def make_optimizer(params: Iterable[torch.nn.Parameter], run: RunConfig) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(list(params), lr=run.lr, betas=run.betas, eps=run.eps, weight_decay=run.weight_decay)
    set_lr(opt, run, 0)
    return opt


def set_lr(opt: torch.optim.Optimizer, run: RunConfig, step: int) -> None:
    """The learning rate of global step ``step`` (AdamW is element-wise, so every party stepping its own parameters
    with the same schedule equals one optimizer over the whole model)."""
    for group in opt.param_groups:
        group["lr"] = run.lr * run.lr_factor(step)


def moment_ratio(betas: tuple[float, float]) -> float | None:
    """``K`` such that every AdamW state holds ``|m| <= K sqrt(v)`` element by element, whatever its gradients were
    (None where no such bound exists: ``b1**2 >= b2``).

    By Cauchy-Schwarz, ``m_t = (1-b1) sum b1^k g`` and ``v_t = (1-b2) sum b2^k g^2`` give ``K**2 = (1-b1)**2 /
    ((1-b2) (1 - b1**2/b2))``, and the bound carries over a step (its square is exactly the fixed point), over a
    plain average of replicas' states (Jensen) and over zero-gradient steps. What breaks it is reducing ``m`` and
    ``v`` apart, each clipped on its own (``swarm/training/robust.py``): then ``v`` may be 0 where ``m`` is not,
    and AdamW divides ``m`` by ``sqrt(0) + eps``."""
    b1, b2 = betas
    if b1 * b1 >= b2:
        return None
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def step_ratio(betas: tuple[float, float], steps: int = 10_000) -> float:
    """The most ``|m_hat| / sqrt(v_hat)`` (AdamW's update per unit of learning rate, before weight decay) can be at
    any step count for a state within ``moment_ratio``: ``K sqrt(1 - b2^t) / (1 - b1^t)``, largest at small ``t``.
    Without ``K`` (``b1**2 >= b2``), infinity."""
    k = moment_ratio(betas)
    if k is None:
        return math.inf
    b1, b2 = betas
    return max(k * math.sqrt(1 - b2**t) / (1 - b1**t) for t in range(1, steps + 1))


def hold_moments(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], betas: tuple[float, float]) -> int:
    """Clamp each first moment, in place, to ``K sqrt(v)`` (``moment_ratio``), so that no step divides a first
    moment by a second moment that cannot go with it; the number of values changed. Elementwise and deterministic:
    replicas that hold the same round's values still hold the same values after it."""
    k = moment_ratio(betas)
    if k is None:
        return 0
    changed = 0
    with torch.no_grad():
        for m, v in zip(exp_avg, exp_avg_sq, strict=True):
            limit = v.clamp_min(0).sqrt().mul_(k)
            changed += int((m.abs() > limit).sum())
            torch.minimum(m, limit, out=m)
            torch.maximum(m, limit.neg_(), out=m)
    return changed


def moments_hold(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], betas: tuple[float, float]) -> bool:
    """Whether a state's moments could be an AdamW's: second moments not negative, first within ``K sqrt(v)`` (with
    room for float32 rounding)."""
    k = moment_ratio(betas)
    for m, v in zip(exp_avg, exp_avg_sq, strict=True):
        if bool((v < 0).any()):
            return False
        if k is not None and bool((m.abs() > v.sqrt() * (k * 1.001) + 1e-30).any()):
            return False
    return True
