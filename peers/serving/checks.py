"""Validation of what a request carries, before any compute: spans, hidden states, masks and positions. Every
failure is a ``BadInputError`` for the caller (or ``PeerUnavailableError`` where another peer may succeed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.errors import BadInputError, PeerUnavailableError
from swarm.ids import Span
from swarm.tuning import is_adapter_name


@dataclass(frozen=True)
class Limits:
    hidden_size: int
    dtype: torch.dtype
    num_blocks: int
    max_batch_tokens: int
    max_positions: int | None = None  # the model's position range (None: unbounded, e.g. no such config field)


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


REQUEST_TENSORS = frozenset({"hidden", "attention_mask", "position_ids", "grad_output"})


def check_names(tensors: dict[str, torch.Tensor], allowed: frozenset[str] = REQUEST_TENSORS) -> None:
    """Every tensor a request carries is one the server reads (or an adapter's): nothing rides along unread."""
    unknown = [n for n in tensors if n not in allowed and not is_adapter_name(n)]
    if unknown:
        raise BadInputError(f"request carries tensors this call does not take: {sorted(unknown)[:8]}")


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
    # an empty batch or sequence would pass every bound above and then reach kernels, caches and session positions
    if hidden.shape[0] == 0:
        raise BadInputError(f"{name} has an empty batch")
    if hidden.shape[1] == 0:
        raise BadInputError(f"{name} has no tokens")
    return hidden


def check_finite(tensor: torch.Tensor, name: str) -> None:
    """NaN or infinity poisons every later step (a session's cache, a trainer's gradients): refuse it here, where
    the caller is known, rather than return garbage that looks like this server's fault."""
    if not bool(torch.isfinite(tensor).all()):
        raise BadInputError(f"{name} holds NaN or infinite values")


def check_aux(
    tensors: dict[str, torch.Tensor], batch: int, n: int, total: int, limits: Limits | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Optional ``attention_mask`` [batch, total] of 0/1 and ``position_ids`` [batch, n] within the model's range,
    both int64 (an out-of-range position would index past the rotary tables)."""
    mask, pos = tensors.get("attention_mask"), tensors.get("position_ids")
    if mask is not None and (mask.dtype != torch.int64 or tuple(mask.shape) != (batch, total)):
        raise BadInputError(f"attention_mask must be int64 [{batch}, {total}], got {mask.dtype} {list(mask.shape)}")
    if pos is not None and (pos.dtype != torch.int64 or tuple(pos.shape) != (batch, n)):
        raise BadInputError(f"position_ids must be int64 [{batch}, {n}], got {pos.dtype} {list(pos.shape)}")
    if mask is not None and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise BadInputError("attention_mask must hold only 0 and 1")
    if pos is not None and pos.numel():
        top = limits.max_positions if limits is not None else None
        if int(pos.min()) < 0 or (top is not None and int(pos.max()) >= top):
            raise BadInputError(f"position_ids must lie in [0, {top if top is not None else 'inf'})")
    return mask, pos
