"""Several sessions' steps through a span as one forward (continuous batching on a server).

Each session keeps its own ``DynamicCache`` (``swarm.families.span.new_cache``), exactly as when it steps alone. A
batched step lays the rows' caches side by side the way Hugging Face lays out a left-padded batch: every row's cached
keys and values end at the same index ``P`` (the longest past among the rows), the positions before a row's own
past are padding, masked out by the 2D attention mask, and every row carries its real position ids (rotary tables,
ALiBi and sliding windows then see what they see when the row runs alone). The family's own code builds the masks
and runs the layers, so every family whose padded batches are exact (the start-up self-check runs one) batches
exactly. After the forward each row's new keys and values are appended to its own cache through the cache layer's
own ``update``: a session's cache is the same object, with the same contents, as if it had stepped alone.

The rows' caches are read once per step into the batch (as transformers' paged cache reads its pages with an
``index_select``); nothing is written back but the new tokens. Sessions whose cache holds other layer kinds than
full and sliding-window attention (linear attention, states) are not batched: ``batchable`` says so and they step
alone."""

from __future__ import annotations

from collections.abc import Sequence
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
    """The padded batch of ``rows`` through ``sub``: inputs, 2D mask, positions and a cache holding everyone's past."""

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
    hidden = torch.cat([r.hidden.to(device) for r in rows])
    # full layers only: the sliding windows are the masks' business (see the module's doc)
    cache = DynamicCache()
    layers: list[DynamicLayer] = [DynamicLayer() for _ in range(sub.start)]  # type: ignore[no-untyped-call]
    for index in range(sub.start, sub.end):
        room = _padded(rows, index, top, n, hidden)
        layers.append(GrowingLayer(room=room, held=top) if room is not None else GrowingLayer())
    cache.layers = list(layers)
    return Batch(hidden, torch.cat(masks), torch.cat(positions), cache, top)


def _padded(
    rows: Sequence[Row], index: int, top: int, n: int, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Room for layer ``index`` of the batch: every row's cached keys and values ending at ``top`` (zeros before:
    padding the mask hides), and ``n`` positions after for the step's own (None: no row has a past)."""
    held = [_held(r.cache, index) for r in rows]
    like = next((kv for kv in held if kv is not None), None)
    if like is None:
        return None
    room = tuple(t.new_empty((hidden.shape[0], *t.shape[1:-2], top + n, t.shape[-1])) for t in like)
    at = 0
    for r, kv in zip(rows, held, strict=True):
        length = kv[0].shape[-2] if kv is not None else 0
        for buf, src in zip(room, kv or (None, None), strict=True):
            buf[at : at + r.rows, ..., : top - length, :] = 0
            if src is not None:
                buf[at : at + r.rows, ..., top - length : top, :] = src
        at += r.rows
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


def scatter(rows: Sequence[Row], batch: Batch, sub: Span) -> None:
    """Append each row's new keys and values (the batch's last positions) to the row's own cache."""
    for index in range(sub.start, sub.end):
        kv = _kv(batch.cache, index)
        assert kv is not None  # the forward filled every layer of the span
        new_k, new_v = kv[0][..., batch.past :, :], kv[1][..., batch.past :, :]
        at = 0
        for r in rows:
            # contiguous copies: a view would keep the whole batch's tensor alive in this session's cache
            assert isinstance(r.cache, DynamicCache)
            r.cache.update(new_k[at : at + r.rows].contiguous(), new_v[at : at + r.rows].contiguous(), index)
            at += r.rows
