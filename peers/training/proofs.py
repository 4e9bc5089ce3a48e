"""What a stage believes about the run's global step: only what a trainer of the run signed.

A trainer signs its ``TrainerProgress`` when it begins a step and carries it in its step notices and in the
training requests of that step. A stage takes a step (an AdamW update of weights the whole run shares) only up to a
step so signed, by a peer the run admits as a trainer, recently."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.errors import BadInputError
from swarm.identity import Signed, open_signed
from swarm.records import TrainerProgress, fresh
from swarm.training.run import RunConfig


@dataclass(frozen=True)
class StepProofs:
    run: RunConfig
    max_age: float  # seconds a signed progress stays good for (``Timing.trainer_stale``)
    skew: float  # clock difference tolerated (``Timing.clock_skew``)

    def step_of(self, proof: Signed | None, now: float) -> int:
        """The step ``proof`` vouches for, or a ``BadInputError`` saying why it vouches for nothing."""
        if proof is None:
            raise BadInputError("taking a step needs the signed progress of a trainer of the run")
        progress = open_signed(proof, TrainerProgress)
        if not self.run.is_trainer(progress.trainer):
            raise BadInputError(f"{progress.trainer} is not a trainer of run {self.run.name}")
        if not fresh([progress], now, self.max_age, self.skew):
            raise BadInputError("the trainer's signed progress is stale or dated in the future")
        return progress.step
