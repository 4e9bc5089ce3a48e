"""The one optimizer of a pre-training run, as every party builds it: AdamW with the run's settings, its learning
rate following the run's schedule of the global step."""

from __future__ import annotations

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
