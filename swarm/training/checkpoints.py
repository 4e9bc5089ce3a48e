"""Checkpoints of every party of a pre-training run (a stage's weights and Adam moments, a trainer's parameters,
optimizer and data position): ``step-NNNNNNN.pt`` files in one folder, written atomically, the last two kept, and
validated against their model when read back (a checkpoint file is input like any other)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.errors import BadInputError

KEEP = 2  # a crash while writing one still leaves the one before


class Checkpoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    step: int = Field(ge=0)


class StageCheckpoint(Checkpoint):
    span: str
    tensors: dict[str, torch.Tensor]  # param.* / exp_avg.* / exp_avg_sq.* (DiLoCo: anchor.*, outer_*.) by names


class TrainerCheckpoint(Checkpoint):
    position: int = Field(ge=0)  # samples consumed from the data
    model: dict[str, torch.Tensor]
    optimizer: dict[str, object]  # torch's optimizer state_dict
    outer: dict[str, torch.Tensor] = {}  # DiLoCo's outer state (``swarm/training/diloco.py``) by part and name


C = TypeVar("C", bound=Checkpoint)


def save(folder: Path, checkpoint: Checkpoint) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{checkpoint.step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(dict(checkpoint), tmp)
    os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous checkpoint intact
    for old in sorted(folder.glob("step-*.pt"))[:-KEEP]:
        old.unlink()
    return path


def latest(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt")) if folder.is_dir() else []
    return found[-1] if found else None


def load_latest(folder: Path, cls: type[C]) -> C | None:
    """The newest checkpoint in ``folder`` as ``cls`` (tensors and plain values only: ``weights_only``), or None."""
    path = latest(folder)
    if path is None:
        return None
    try:
        return cls.model_validate(torch.load(path, weights_only=True))
    except ValidationError as e:
        raise BadInputError(f"{path} is not a {cls.__name__} of this version: {e}") from None


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha-256 of a stage's state (names, dtypes, shapes and bytes, in name order): what a replica signs for the
    state it ended an averaging round with, and what a peer that downloads that state checks."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
