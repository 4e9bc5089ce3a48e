"""Several sessions' steps through a span as one forward (continuous batching on a server).

Each session keeps its own ``DynamicCache`` (``swarm.families.span.new_cache``), exactly as when it steps alone. A
batched step lays the rows' caches side by side the way Hugging Face lays out a left-padded batch: every row's cached
keys and values end at the same index ``P`` (the longest past among the rows), the positions before a row's own
past are padding, masked out by the 2D attention mask, and every row carries its real position ids (rotary tables,
ALiBi and sliding windows then see what they see when the row runs alone). The family's own code builds the masks
and runs the layers, so every family whose padded batches are exact (the start-up self-check runs one) batches
exactly. Each layer appends each row's new keys and values to the row's own cache through that cache layer's own
``update``: a session's cache is the same object, with the same contents, as if it had stepped alone.

The rows' caches are read once per step and layer into the batch's room for that layer (as transformers' paged
cache reads its pages with an ``index_select``), which is dropped when the layer is done; nothing is written back
but the new tokens. A batch that fails half way gives each row's cache back what it added (``undo``).

Sessions whose cache holds other layer kinds than full and sliding-window attention (linear attention, states) are
not batched: ``batchable`` says so and they step alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from peers.serving.adapters import Adapter
from peers.serving.runtime import Row
from swarm.families.span import GrowingLayer
from swarm.ids import Span

_PLAIN_LAYERS = (GrowingLayer, DynamicLayer, DynamicSlidingWindowLayer)


class RowAdapters:
    """The adapters of a batch's rows: LoRA hooks add each row's own delta (``SpanBackend``)."""

    def __init__(self, parts: Sequence[tuple[slice, Adapter]]) -> None:
        self.parts = list(parts)

    def delta(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` of the linear at ``key`` with each row's LoRA delta added (a new tensor; ``out`` untouched)."""
        result = out
        for rows, adapter in self.parts:
            pair = adapter.lora.get(key)
            if pair is None:
                continue
            if result is out:
                result = out.clone()
            a, b = pair
            result[rows] += F.linear(F.linear(x[rows], a), b) * adapter.scaling
        return result


def batchable(cache: object | None) -> bool:
    """Whether a session's cache can join a batch: a ``DynamicCache`` of full and sliding-window attention layers
    (the layout a padded batch reproduces)."""
    if type(cache) is not DynamicCache:
        return False
    return all(type(layer) in _PLAIN_LAYERS for layer in cache.layers)


def rows_adapters(rows: Sequence[Row]) -> RowAdapters | None:
    parts: list[tuple[slice, Adapter]] = []
    at = 0
    for row in rows:
        if row.adapter is not None and row.adapter.lora:
            parts.append((slice(at, at + row.rows), row.adapter))
        at += row.rows
    return RowAdapters(parts) if parts else None


@dataclass(frozen=True)
class Batch:
    """The padded batch of ``rows`` through ``sub``: inputs, 2D mask, positions and a cache over everyone's past."""

    hidden: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    cache: DynamicCache
    past: int  # P: every row's past ends here


def assemble(rows: Sequence[Row], sub: Span, device: torch.device) -> Batch:
    """Lay ``rows`` out as one left-padded batch (see the module's doc)."""
    n = int(rows[0].hidden.shape[1])
    if any(int(r.hidden.shape[1]) != n for r in rows):
        raise ValueError("rows of one batch take the same number of tokens")
    top = max(r.past for r in rows)
    masks, positions = [], []
    for r in rows:
        own = r.mask.to(device) if r.mask is not None else torch.ones(r.rows, r.past + n, device=device)
        masks.append(F.pad(own.to(torch.long), (top - r.past, 0)))
        if r.pos is not None:
            positions.append(r.pos.to(device))
        else:
            positions.append(torch.arange(r.past, r.past + n, device=device).unsqueeze(0).expand(r.rows, -1))
    cache = DynamicCache()
    skipped: list[DynamicLayer] = [DynamicLayer() for _ in range(sub.start)]
    cache.layers = [*skipped, *(_BatchLayer(rows, index, top) for index in range(sub.start, sub.end))]
    return Batch(torch.cat([r.hidden.to(device) for r in rows]), torch.cat(masks), torch.cat(positions), cache, top)


class _BatchLayer(DynamicLayer):
    """Layer ``index`` of a batch, seen by the model as one full-attention layer of ``top`` past positions. Its room
    (every row's past, left-padded) is gathered when the layer runs and dropped once its attention is done, so a batch
    holds one layer's room at a time; the step's own keys and values go straight to each row's cache, through that
    cache's own layer (as when the row runs alone, where the layer updates its cache before attending)."""

    def __init__(self, rows: Sequence[Row], index: int, top: int) -> None:
        init: Callable[[], None] = super().__init__  # typed here: transformers leaves it unannotated
        init()
        self.rows, self.index, self.top = rows, index, top
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.top

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.top + query_length, 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        held = [_held(r.cache, self.index) for r in self.rows]
        # zeroed at once (one fill, where zeroing each row's padding was two more small writes per row and layer)
        room = tuple(s.new_zeros((*s.shape[:-2], self.top + n, s.shape[-1])) for s in (key_states, value_states))
        at = 0
        for r, kv in zip(self.rows, held, strict=True):
            rows = slice(at, at + r.rows)
            if kv is not None:
                length = kv[0].shape[-2]
                room[0][rows, ..., self.top - length : self.top, :] = kv[0]
                room[1][rows, ..., self.top - length : self.top, :] = kv[1]
            assert isinstance(r.cache, DynamicCache)
            r.cache.update(key_states[rows].contiguous(), value_states[rows].contiguous(), self.index)
            at += r.rows
        room[0][..., self.top :, :] = key_states
        room[1][..., self.top :, :] = value_states
        return room[0], room[1]


def _held(cache: object, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values layer ``index`` of ``cache`` holds (None: none yet)."""
    kv = _kv(cache, index)
    return kv if kv is not None and kv[0].numel() > 0 else None


def _kv(cache: object, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    assert isinstance(cache, DynamicCache)
    if index >= len(cache.layers):
        return None
    layer = cache.layers[index]
    if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
        return None
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def lengths(rows: Sequence[Row], sub: Span) -> list[list[int]]:
    """What each row's cache holds per layer of ``sub`` (to undo a batch that failed half way: ``undo``)."""
    return [[_length(r.cache, i) for i in range(sub.start, sub.end)] for r in rows]


def undo(rows: Sequence[Row], sub: Span, before: list[list[int]]) -> None:
    """Give every row's cache back what a failed batch added to it, layer by layer."""
    for r, held in zip(rows, before, strict=True):
        assert isinstance(r.cache, DynamicCache)
        for index, length in zip(range(sub.start, sub.end), held, strict=True):
            extra = _length(r.cache, index) - length
            layer = r.cache.layers[index]
            if extra > 0 and isinstance(layer, DynamicLayer):
                layer.crop(-extra)


def _length(cache: object, index: int) -> int:
    kv = _kv(cache, index)
    return int(kv[0].shape[-2]) if kv is not None else 0
