"""The ports a stage plugs into the serving domain, beside ``Stage`` itself (``peers.serving.stage_port``): a span whose
weights learn gives compute a ``Learner``; a trainable stage gives the handlers its ``TrainingRpc``. Pre-training's
stage implements both (``peers.training``); a serving stage neither."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from swarm import wire
from swarm.protocol import Message, StateRequest, StepNotice, TrainTag

Tensors = dict[str, torch.Tensor]


class Learner(Protocol):
    """A span whose weights learn (``peers.training.span_trainer.SpanTrainer``)."""

    params: list[torch.nn.Parameter]

    def admit(self, tag: TrainTag) -> None:
        """Bring the span to the request's global step, or refuse a request of a step already done."""

    def accumulate(
        self, grads: Sequence[torch.Tensor | None], samples: int, trainer: str, micro: str | None = None
    ) -> None:
        """Add a micro-batch's weight gradients toward the global batch (and step when it is complete); refuse a
        non-finite one, bound a huge one, count the samples per trainer; a micro-batch (``micro``) counts once."""

    @property
    def pending(self) -> bool:
        """A step was applied whose averaging round and checkpoint are still to do."""

    def finish_step(self) -> None: ...

    @property
    def averaging_bytes(self) -> int:
        """Bytes this replica has sent to its groupmates in averaging rounds."""

    @property
    def rounds_undone(self) -> int:
        """Averaging rounds whose result this replica undid (``peers/training/replica_health.py``)."""

    @property
    def replica_heals(self) -> int:
        """Fresh state copies this replica took from its replicas after it was found apart from them."""


class TrainingRpc(Protocol):
    """What a trainable stage answers beyond forward and backward (``peers.training.trainable_stage``)."""

    async def state(self, req: StateRequest, caller: str, budget: wire.ByteBudget | None) -> StateCopy:
        """A copy of the stage's state for ``caller``, admitted and counted (``budget``: the server's bytes held)
        until its reply is sent, or ``BusyError``."""

    async def step(self, notice: StepNotice) -> None: ...


class StateCopy(Protocol):
    """An admitted state copy (``peers.training.state_gate``)."""

    def frames(self, encode: Callable[[Message, Tensors], list[wire.Frame]]) -> list[wire.Frame]:
        """Its reply encoded; the copy counts until these frames are gone."""
