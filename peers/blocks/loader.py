"""Selective loading of a span of blocks: open only the shards that hold them and read only their tensors."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from swarm.errors import BadInputError
from swarm.families import weights
from swarm.families.spec import Family
from swarm.ids import Span

log = logging.getLogger(__name__)


def load_span(folder: Path, family: Family, span: Span, dtype: torch.dtype, device: str) -> torch.nn.ModuleList:
    """Build the span's layers on the meta device and assign the tensors read from disk (no double allocation), in
    the layouts the family's modules hold (fused experts, ...)."""
    if span.end > family.num_layers:
        raise BadInputError(f"blocks {span} exceed the model's {family.num_layers} blocks")
    return torch.nn.ModuleList(weights.load_layers(family, folder, range(span.start, span.end), dtype, device))


def block_bytes(folder: Path, family: Family, dtype: torch.dtype) -> int:
    """Bytes the largest block takes in ``dtype``, from the safetensors headers alone (mixture-of-experts models mix
    small dense blocks with large expert ones: planning by the largest never overcommits memory)."""
    return max(weights.block_bytes(family, folder, dtype), default=0)
