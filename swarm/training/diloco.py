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
from where they are and the next round's pseudo-gradient spans both periods.

A stage replica's round overlaps its next inner steps (``outcome`` computed while they run, ``adopt`` at the first
step boundary after it): the new start is the same on every replica, and each keeps the inner progress it made
during the round on top of it (as overlapping DiLoCo variants do)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.training.run import Sync

OUTER_PARTS = ("anchor.", "outer_m.", "outer_e.")  # the round's start, the outer momentum, what top-k left over


@dataclass(frozen=True)
class Outcome:
    """An outer step's result: the new start, the outer momentum, and what top-k leaves for the next round."""

    anchor: list[torch.Tensor]
    momentum: list[torch.Tensor]
    left: list[torch.Tensor]


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
    def outcome(self, averaged: Sequence[torch.Tensor] | None = None) -> Outcome:
        """The outer step on the group's average (``None``: alone, on this party's whole pseudo-gradient), as new
        tensors: nothing here changes (a round in flight computes it while the inner steps go on)."""
        if averaged is None:
            averaged = self.whole()
            left = [torch.zeros_like(p) for p in self.params]
        else:
            left = self._left if self._left is not None else [torch.zeros_like(p) for p in self.params]
        mu, lr = self.sync.outer_momentum, self.sync.outer_lr
        momentum = [m * mu + g for m, g in zip(self.momentum, averaged, strict=True)]
        anchor = [a - lr * (g + mu * m) for a, g, m in zip(self.anchor, averaged, momentum, strict=True)]
        return Outcome(anchor, momentum, left)

    @torch.no_grad()
    def adopt(self, outcome: Outcome, since: Sequence[torch.Tensor] | None = None) -> None:
        """Take the outer step: the weights restart from the new start, keeping what inner steps added ``since``
        the weights the round's pseudo-gradient was taken from (a round that overlapped them; None: none did)."""
        for p, anchor, old, new in zip(self.params, self.anchor, since or self.params, outcome.anchor, strict=True):
            if since is None:
                p.copy_(new)
            else:
                p.add_(new - old)
            anchor.copy_(new)
        for m, new in zip(self.momentum, outcome.momentum, strict=True):
            m.copy_(new)
        self.error, self._left = outcome.left, None

    def step(self, averaged: Sequence[torch.Tensor] | None = None) -> None:
        """The outer step at once (``outcome`` then ``adopt``)."""
        self.adopt(self.outcome(averaged))

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
