"""Whether a stage replica still holds weights honest training could have given it, and when it should take a fresh
state copy from its replicas instead of averaging on.

Replicas of a stage that average every few steps hold nearly the same weights; a round whose result would move a
replica's weights further than that is undone (``peers/training/span_trainer.py``). Undone rounds that go on mean
the replicas are apart, and averaging alone will not bring them together: someone must take a copy. Who:

- the replica whose weights lie beyond what AdamW could have moved them since the last state it has reason to
  trust (its anchor: the state it started from, or the result of its last accepted round). An AdamW step moves a
  weight by at most ``lr * (R + wd |w|)`` (``R``: ``swarm.training.optim.step_ratio``), so that reach is a sum over
  the steps since the anchor, checked before each round. Such a replica is the one that is off: it sits out rounds
  and takes a copy at once;
- otherwise, after ``APART_ROUNDS`` rounds in a row undone, a replica takes a copy only from a majority: a round
  that two other replicas signed alike (``swarm.training.state``). Two replicas that both look sound never swap
  states on each other's word.

The copy itself is fetched and checked by the stage (``peers/training/trainable_stage.py``), imported on the compute
thread, logged, and counted (``swarm_peer_replica_heals_total``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peers.training.outer_rounds import implausible
from swarm.training.averaging import round_slack
from swarm.training.optim import hold_moments, step_ratio
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
APART_ROUNDS = 3  # rounds undone in a row after which replicas that both look sound are apart
SLACK = 1e-6  # per element, beyond the reach: float32 rounding of the steps themselves


@dataclass(frozen=True)
class Wanted:
    """A fresh state copy this replica should take: why, and whether only a majority's round may give it."""

    reason: str
    majority_only: bool


class ReplicaHealth:
    def __init__(self, run: RunConfig, params: Sequence[torch.Tensor], span: str) -> None:
        self.run, self.span = run, span
        self.ratio = step_ratio(run.betas)
        self.anchor_step = 0
        self.anchor: list[torch.Tensor] = [p.detach().to("cpu", copy=True) for p in params]
        self.undone = 0  # rounds undone in a row
        self.rounds_undone = 0  # in all (a metric)
        self.heals = 0  # fresh copies taken (a metric)
        self.wanted: Wanted | None = None

    def trust(self, step: int, params: Sequence[torch.Tensor]) -> None:
        """These weights, at ``step``, are ones this replica has reason to trust (a state it loaded, a round it
        accepted): later drift is measured from them."""
        self.anchor_step = step
        self.anchor = [p.detach().to("cpu", copy=True) for p in params]
        self.undone = 0
        self.wanted = None

    def healed(self) -> None:
        """A copy was taken (and, imported, trusted)."""
        self.heals += 1
        self.wanted = None

    def reach(self, step: int) -> float:
        """The most AdamW can have moved any weight from the anchor by ``step`` (weight decay taken at the largest
        anchored weight: one bound for every tensor, one pass over the steps)."""
        run = self.run
        scale = max((float(a.abs().max()) for a in self.anchor if a.numel()), default=0.0)
        moved = 0.0
        for t in range(self.anchor_step, step):
            moved += run.lr * run.lr_factor(t) * (self.ratio + run.weight_decay * (scale + moved))
        return moved

    def drift(self, step: int, params: Sequence[torch.Tensor]) -> str | None:
        """Why these weights, at ``step``, cannot come from the anchor by AdamW steps (None if they can)."""
        most = self.reach(step)
        for i, (p, a) in enumerate(zip(params, self.anchor, strict=True)):
            moved = float((p.detach().cpu() - a).abs().max()) if a.numel() else 0.0
            if not moved <= most * 1.01 + SLACK:  # NaN too
                return (
                    f"weight tensor {i} moved {moved:.3g} from its state of step {self.anchor_step}, more than "
                    f"AdamW can in {step - self.anchor_step} steps ({most:.3g})"
                )
        return None

    def check(self, step: int, params: Sequence[torch.Tensor]) -> bool:
        """Before a round: whether this replica is off (its weights beyond AdamW's reach from its anchor). One that
        is off wants a copy at once, and takes part in no round and signs none until it has one."""
        if not self.off:
            why = self.drift(step, params)
            if why is not None:
                self.want(Wanted(why, majority_only=False))
        return self.off

    def settle(self, step: int, tensors: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
        """Judge a completed round's result in ``tensors`` (weights, then both Adam moments; ``before``: as they
        were). Undone (back to ``before``) when it is not finite, holds a negative second moment (Adam would take
        its square root), or moves a weight tensor further than replicas that average every few steps can differ
        (``implausible``: a groupmate that reduced a part returned garbage for it). Kept otherwise, its moments
        held together, and trusted. Whether it was kept."""
        n = len(self.anchor)
        why = implausible(tensors[:n], before[:n], round_slack(self.run))
        if why is None and not all(bool(torch.isfinite(t).all()) for t in tensors):
            why = "it is not finite"
        if why is None and any(bool((t < 0).any()) for t in tensors[2 * n :]):
            why = "it holds a negative second moment"
        if why is not None:
            log.warning("averaging round undone: %s", why, extra={"span": self.span})
            with torch.no_grad():
                for t, b in zip(tensors, before, strict=True):
                    t.copy_(b)
            self.undone += 1
            self.rounds_undone += 1
            if self.undone >= APART_ROUNDS:
                self.want(Wanted(f"{self.undone} averaging rounds in a row undone", majority_only=True))
            return False
        # Each moment's parts were reduced (and clipped) on their own: a first moment may have kept a value its
        # second moment lost (a groupmate with no moments yet reduced that part), which AdamW would divide by eps.
        held = hold_moments(tensors[n : 2 * n], tensors[2 * n :], self.run.betas)
        if held:
            log.info("averaging: %d first-moment values held to AdamW's bound", held, extra={"span": self.span})
        self.trust(step, tensors[:n])
        return True

    @property
    def off(self) -> bool:
        """This replica found itself off: it takes no part in rounds until it has a copy."""
        return self.wanted is not None and not self.wanted.majority_only

    def want(self, wanted: Wanted) -> None:
        """Ask for a copy (a replica that is off outranks replicas merely apart)."""
        if self.wanted is not None and not self.wanted.majority_only:
            return
        if self.wanted is None or not wanted.majority_only:
            log.warning("apart from its replicas: %s", wanted.reason, extra={"span": self.span})
        self.wanted = wanted
