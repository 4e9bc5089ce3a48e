"""Validation of what a request carries, before any compute: spans, hidden states, masks and positions. Every
failure is a ``BadInputError`` for the caller (or ``PeerUnavailableError`` where another peer may succeed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.errors import BadInputError, PeerUnavailableError
from swarm.ids import Span


@dataclass(frozen=True)
class Limits:
    hidden_size: int
    dtype: torch.dtype
    num_blocks: int
    max_batch_tokens: int


def check_sub(held: Span | None, start: int, end: int, num_blocks: int) -> Span:
    """Blocks ``start:end`` of a request, which this peer (holding ``held``, None while joining or standby) must
    serve."""
    if held is None:
        raise PeerUnavailableError("this peer serves no blocks right now (joining or standby)")
    if not 0 <= start < end:
        raise BadInputError(f"invalid block span {start}:{end}")
    if end > num_blocks:
        raise BadInputError(f"unknown blocks {start}:{end}: the model has {num_blocks} blocks")
    sub = Span(start, end)
    if sub not in held:  # a stale view of the swarm, most likely: retriable elsewhere
        raise PeerUnavailableError(f"this server holds blocks {held}, not {sub}")
    return sub


def check_hidden(tensors: dict[str, torch.Tensor], limits: Limits, name: str = "hidden") -> torch.Tensor:
    hidden = tensors.get(name)
    if hidden is None:
        raise BadInputError(f"request has no {name!r} tensor")
    if hidden.ndim != 3 or hidden.shape[-1] != limits.hidden_size:
        raise BadInputError(f"{name} must be [batch, seq, {limits.hidden_size}], got {list(hidden.shape)}")
    if hidden.dtype != limits.dtype:
        raise BadInputError(f"{name} must be {limits.dtype}, got {hidden.dtype}")
    if hidden.shape[0] * hidden.shape[1] > limits.max_batch_tokens:
        raise BadInputError(f"batch x seq {hidden.shape[0] * hidden.shape[1]} exceeds {limits.max_batch_tokens}")
    if hidden.shape[1] == 0:
        raise BadInputError(f"{name} has no tokens")
    return hidden


def check_aux(
    tensors: dict[str, torch.Tensor], batch: int, n: int, total: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Optional ``attention_mask`` [batch, total] and ``position_ids`` [batch, n], both int64."""
    mask, pos = tensors.get("attention_mask"), tensors.get("position_ids")
    if mask is not None and (mask.dtype != torch.int64 or tuple(mask.shape) != (batch, total)):
        raise BadInputError(f"attention_mask must be int64 [{batch}, {total}], got {mask.dtype} {list(mask.shape)}")
    if pos is not None and (pos.dtype != torch.int64 or tuple(pos.shape) != (batch, n)):
        raise BadInputError(f"position_ids must be int64 [{batch}, {n}], got {pos.dtype} {list(pos.shape)}")
    return mask, pos
