"""DiLoCo's outer loop for one party's parameters (a stage replica's blocks, or a trainer's embeddings and head).

Between rounds each replica takes ``average_every`` inner AdamW steps on its own micro-batches. At a round the
replicas average their pseudo-gradients, ``start - end`` of the round (``OuterSync.prepare`` writes them into the
buffers hivemind's averager holds), and every replica steps the same outer optimizer on the same average: SGD with
Nesterov momentum, ``m = mu m + g``, ``start -= lr (g + mu m)``, and the weights restart from the new start. Adam's
moments stay each replica's own (as in DiLoCo). With ``compression = "topk"`` a replica sends, per tensor, only its
``density`` largest values of the pseudo-gradient plus what earlier rounds did not send (error feedback), and keeps
the rest for the next round; the codec (``swarm/training/codec.py``) sends those values at 8 bits.

A replica alone (or a trainer alone) steps on its own whole pseudo-gradient: one-replica DiLoCo, what a one-process
reference computes (``swarm/client/training/local.py``). A round that fails changes nothing: the inner steps go on
from where they are and the next round's pseudo-gradient spans both periods."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarm.training.run import Sync

OUTER_PARTS = ("anchor.", "outer_m.", "outer_e.")  # the round's start, the outer momentum, what top-k left over


class OuterSync:
    def __init__(self, params: Sequence[torch.Tensor], sync: Sync) -> None:
        self.params, self.sync = list(params), sync
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.error = [torch.zeros_like(p) for p in self.params]
        self.buffers = [torch.zeros_like(p) for p in self.params]  # what the averager holds and averages in place
        self._left: list[torch.Tensor] | None = None  # the error feedback a successful round keeps

    @torch.no_grad()
    def whole(self) -> list[torch.Tensor]:
        """This party's whole pseudo-gradient of the round, with what earlier rounds left over."""
        return [a - p.detach() + e for a, p, e in zip(self.anchor, self.params, self.error, strict=True)]

    @torch.no_grad()
    def prepare(self) -> list[torch.Tensor]:
        """Write into ``buffers`` what this party sends this round, and return a copy of it."""
        for buffer, g in zip(self.buffers, self.whole(), strict=True):
            buffer.copy_(top_k(g, self.sync.density) if self.sync.compression == "topk" else g)
        if self.sync.compression == "topk":
            self._left = [g - b for g, b in zip(self.whole(), self.buffers, strict=True)]
        return [b.clone() for b in self.buffers]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor] | None = None) -> None:
        """The outer step on the group's average (``None``: alone, on this party's whole pseudo-gradient), and the
        weights restart from the new start."""
        if averaged is None:
            averaged = self.whole()
            left = [torch.zeros_like(p) for p in self.params]
        else:
            left = self._left if self._left is not None else [torch.zeros_like(p) for p in self.params]
        mu, lr = self.sync.outer_momentum, self.sync.outer_lr
        for anchor, m, g, p in zip(self.anchor, self.momentum, averaged, self.params, strict=True):
            m.mul_(mu).add_(g)
            anchor.sub_(g + mu * m, alpha=lr)
            p.copy_(anchor)
        self.error, self._left = left, None

    def state(self) -> dict[str, list[torch.Tensor]]:
        return dict(zip(OUTER_PARTS, (self.anchor, self.momentum, self.error), strict=True))

    @torch.no_grad()
    def load(self, parts: dict[str, list[torch.Tensor] | None]) -> None:
        """The outer state by part (``OUTER_PARTS``); a missing part: the start is the weights as they are now, the
        momentum and the leftover zero (a state taken from a round, where the weights are the start)."""
        defaults = ([p.detach() for p in self.params], None, None)
        for part, default, target in zip(OUTER_PARTS, defaults, (self.anchor, self.momentum, self.error), strict=True):
            source = parts.get(part) or default
            for t, s in zip(target, source or [torch.zeros_like(t) for t in target], strict=True):
                t.copy_(s)


def top_k(values: torch.Tensor, density: float) -> torch.Tensor:
    """``values`` with all but its ``density`` largest magnitudes (at least one) set to zero."""
    flat = values.reshape(-1)
    k = max(1, math.ceil(density * flat.numel()))
    if k >= flat.numel():
        return values.clone()
    kept = torch.zeros_like(flat)
    index = flat.abs().topk(k, sorted=False).indices
    kept[index] = flat[index]
    return kept.view_as(values)
