"""What a stage believes about the run's global step: only what a trainer of the run signed, and only so far.

A trainer signs its ``TrainerProgress`` when it begins a step and carries it in its step notices and in the
training requests of that step. A stage takes a step (an AdamW update of weights the whole run shares) only up to a
step so signed, by a peer the run admits as a trainer, recently.

A signature proves who claims a step, not that the step happened: in an open run anyone is a trainer, and one
self-signed progress of step 10^12 would end the learning-rate schedule for good. So one identity's word moves a
stage at most ``catch_up_limit`` steps past the step the stage reached on other evidence (``StepClaims.earned``: a
step it took with samples, a state it loaded), however many notices it sends; a training request (which brings its
samples and costs its sender a forward and a backward) moves it at most that far past its current step. Further
only where two of a closed run's listed trainers signed it (identities cost nothing in an open run: there no number
of them is a quorum)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.errors import BadInputError
from swarm.identity import Signed, open_signed
from swarm.records import TrainerProgress, fresh
from swarm.training.run import RunConfig


@dataclass(frozen=True)
class StepProofs:
    run: RunConfig
    max_age: float  # seconds a signed progress stays good for (``Timing.trainer_stale``)
    skew: float  # clock difference tolerated (``Timing.clock_skew``)

    def progress_of(self, proof: Signed | None, now: float) -> TrainerProgress:
        """The signed progress ``proof`` holds, or a ``BadInputError`` saying why it vouches for nothing."""
        if proof is None:
            raise BadInputError("taking a step needs the signed progress of a trainer of the run")
        progress = open_signed(proof, TrainerProgress)
        if not self.run.is_trainer(progress.trainer):
            raise BadInputError(f"{progress.trainer} is not a trainer of run {self.run.name}")
        if not fresh([progress], now, self.max_age, self.skew):
            raise BadInputError("the trainer's signed progress is stale or dated in the future")
        return progress

    def step_of(self, proof: Signed | None, now: float) -> int:
        return self.progress_of(proof, now).step


@dataclass
class StepClaims:
    """The steps trainers signed, and how far they let a stage go (pure: no clock, no I/O). Memory is bounded: one
    number per listed trainer of a closed run, three numbers otherwise."""

    run: RunConfig
    highest: int = 0  # the furthest step any trainer signed: a stage never goes beyond it
    earned: int = 0  # the furthest step the stage reached on its own evidence (samples it stepped on, a loaded state)
    agreed: int = 0  # the furthest step two listed trainers of a closed run both signed
    latest: dict[str, int] = field(default_factory=dict)  # per listed trainer (closed runs of two or more only)

    @property
    def bound(self) -> int:
        """Most steps one identity's word moves a stage."""
        return self.run.catch_up_limit

    def note(self, trainer: str, step: int) -> None:
        """``trainer`` signed that the run is at ``step`` (the signature and freshness already checked)."""
        self.highest = max(self.highest, step)
        if len(self.run.trainers) >= 2 and trainer in self.run.trainers:
            self.latest[trainer] = max(self.latest.get(trainer, 0), step)
            if len(self.latest) >= 2:
                self.agreed = max(self.agreed, sorted(self.latest.values())[-2])

    def reached(self, step: int) -> None:
        """The stage is at ``step`` on its own evidence."""
        self.earned = max(self.earned, step)

    def reach(self, step: int, work: bool) -> int:
        """The furthest step a stage now at ``step`` may go to: on a training request's word (``work``), at most
        ``bound`` past ``step``; on a notice or progress record alone, at most ``bound`` past ``earned``; past
        either only as far as two listed trainers agree; never beyond what anyone signed, never backwards."""
        anchor = max(step if work else self.earned, self.agreed)
        return max(step, min(self.highest, anchor + self.bound))
