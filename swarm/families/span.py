"""What a server's span feeds its layers on each call, per family: positions, masks by layer type (built from the
family's config, so their form fits its attention implementation: additive floats for eager), rotary tables
(none, one, or one per layer type), ALiBi biases (BLOOM, Falcon-ALiBi), and the keyword each layer takes its cache
under. Everything inside a layer (soft-capping, sinks, parallel attention, latent attention, experts) is the layer's
own code; this module only reproduces what the Hugging Face model does around its layers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from swarm.families.family import Family

Rotary = tuple[torch.Tensor, torch.Tensor]
# layer kinds of softmax attention over a causal mask (the others: linear attention, convolutions, state spaces)
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")


@dataclass
class SpanInputs:
    """Per-call inputs of the layers of one span (``indices``: global layer indices)."""

    position_ids: torch.Tensor
    masks: dict[str, object]  # layer kind -> mask (a tensor, a BlockMask or None: what the layer's attention takes)
    rotary: dict[str, Rotary | None]  # layer kind -> (cos, sin)
    alibi: torch.Tensor | None = None


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that writes each step's keys and values in place, into room it grows ahead
    (by a quarter, at least 16 tokens, never past ``limit``), where transformers' ``DynamicLayer`` concatenates: a
    copy of the whole past at every step. ``keys`` and ``values`` are views of what it holds."""

    def __init__(self, limit: int | None = None, room: tuple[torch.Tensor, torch.Tensor] | None = None, held: int = 0):
        init: Callable[[], None] = super().__init__  # typed here: transformers leaves it unannotated
        init()
        self.limit = limit
        self._room = room  # (keys, values) with room for more positions than held
        self._held = 0
        if room is not None:  # a batch's layer: its past already in place (``peers.blocks.batched``)
            self.is_initialized, self.device, self._held = True, room[0].device, held
            self._view()

    def _view(self) -> None:
        assert self._room is not None
        self.keys, self.values = self._room[0][..., : self._held, :], self._room[1][..., : self._held, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._held + key_states.shape[-2]
        room = self._room
        if room is None or end > room[0].shape[-2] or room[0].shape[:-2] != key_states.shape[:-2]:
            size = end + max(16, end // 4)
            size = min(size, max(end, self.limit)) if self.limit is not None else size
            grown = tuple(s.new_empty((*s.shape[:-2], size, s.shape[-1])) for s in (key_states, value_states))
            if room is not None and self._held:
                for new, old in zip(grown, room, strict=True):
                    new[..., : self._held, :] = old[..., : self._held, :]
            room = self._room = (grown[0], grown[1])
        room[0][..., self._held : end, :] = key_states
        room[1][..., self._held : end, :] = value_states
        self._held = end
        self._view()
        return room[0][..., :end, :], room[1][..., :end, :]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes how many tokens to remove, as a negative number")
        if tokens_to_remove == 0 or not self.is_initialized or self._room is None:
            return
        self._held = max(0, self._held + tokens_to_remove)
        self._view()

    def reset(self) -> None:
        super().reset()
        self._room, self._held = None, 0


def new_cache(family: Family, max_length: int | None = None) -> DynamicCache:
    """A session's cache: transformers' own layers for the family's layer kinds, full-attention layers written in
    place (``GrowingLayer``: room for ``max_length`` positions at most)."""
    cache = DynamicCache(config=family.config)
    # where the model masks every layer in full whatever its config's window (Moshi's), every layer keeps all tokens
    full = (DynamicLayer,) if family.spec.window_masks else (DynamicLayer, DynamicSlidingWindowLayer)
    cache.layers = [GrowingLayer(max_length) if type(layer) in full else layer for layer in cache.layers]
    # Sliding-window layers then keep the last step's tokens beyond their window until the next step settles them
    # (``peers.serving.sessions._rewind``), so a step sent again after a repair upstream can be redone: without it,
    # transformers can crop a sliding layer only before it fills its window.
    cache.activate_past_recording()
    return cache


def takes_back(family: Family) -> bool:
    """Whether a session's cache can forget its last positions: not where recurrent (state-space, linear-attention)
    states fold every token in for good (speculative decoding's rejected drafts could not be dropped)."""
    cache = DynamicCache(config=family.config)
    return not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def span_inputs(
    family: Family,
    rotary: torch.nn.Module | None,
    hidden: torch.Tensor,
    indices: Sequence[int],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: DynamicCache | None = None,
    past: int = 0,
) -> SpanInputs:
    """``hidden`` [batch, n, hidden] entering layers ``indices`` with ``past`` tokens cached; ``attention_mask``
    [batch, past + n] of 0/1 (None: no padding)."""
    batch, n = hidden.shape[:2]
    device = hidden.device
    if position_ids is None:
        position_ids = torch.arange(past, past + n, device=device).unsqueeze(0).expand(batch, -1)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    config, spec = family.config, family.spec
    kinds: dict[str, int] = {}
    for i in indices:
        kinds.setdefault(family.layer_kind(i), i)
    layer_kinds = list(kinds)
    for _, kind in spec.mask_keywords:  # masks passed by a fixed kind (Falcon-H1's recurrent mask)
        kinds.setdefault(kind, indices[0])
    masks: dict[str, object] = {}
    for kind, first in kinds.items():
        if kind not in ATTENTION_KINDS:  # linear attention, convolutions, state-space layers: the 2D padding mask
            # of the new tokens where there is padding, as transformers' hybrid models pass them
            masks[kind] = create_recurrent_attention_mask(config, hidden, attention_mask, cache)
            continue
        make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        masks[kind] = make(
            config=config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=first,
            allow_is_causal_skip=not spec.materialize_mask,
        )
    tables: dict[str, Rotary | None] = {kind: None for kind in layer_kinds}  # by the layers' own kinds
    if rotary is not None:
        if spec.rotary == "per_layer_type":  # a kind whose RoPE parameters are None has no positions (Beam's NoPE)
            ropes = getattr(config, "rope_parameters", None)
            known = getattr(rotary, "rope_type", None)  # the kinds it holds tables for (LFM3's convolutions: none)
            tables = {
                kind: None
                if (isinstance(ropes, dict) and kind in ropes and ropes[kind] is None)
                or (isinstance(known, dict) and kind not in known)
                else rotary(hidden, position_ids, kind)
                for kind in layer_kinds
            }
        else:
            shared = rotary(hidden, position_ids)
            tables = {kind: shared for kind in layer_kinds}
    alibi = None
    if spec.call == "bloom":
        alibi = _bloom_alibi(family, hidden, attention_mask, past)
    elif spec.call == "falcon" and getattr(config, "alibi", False):
        alibi, masks = _falcon_alibi(family, hidden, attention_mask, past, masks)
    return SpanInputs(position_ids, masks, tables, alibi)


def _bloom_alibi(family: Family, hidden: torch.Tensor, mask: torch.Tensor | None, past: int) -> torch.Tensor:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor

    heads = int(family.config.n_head)
    batch, n = hidden.shape[:2]
    if mask is None:  # as BloomModel: slopes x key position, without materialising an all-ones mask
        slopes = _get_alibi_slopes(heads, hidden.device)
        alibi = slopes[:, None, None] * torch.arange(past + n, device=hidden.device)
        return alibi.repeat(batch, 1, 1).to(hidden.dtype)
    out: torch.Tensor = build_alibi_tensor(mask, heads, hidden.dtype)
    return out


def _falcon_alibi(
    family: Family, hidden: torch.Tensor, mask: torch.Tensor | None, past: int, masks: dict[str, object]
) -> tuple[torch.Tensor, dict[str, object]]:
    """As FalconModel: ALiBi from the 2D mask, folded into the (materialised) 4D mask of every kind."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    config = family.config
    heads = int(config.num_attention_heads)
    batch, n = hidden.shape[:2]
    if mask is None:
        mask = torch.ones((batch, past + n), device=hidden.device, dtype=torch.long)
    alibi: torch.Tensor = build_alibi_tensor(mask, heads, dtype=hidden.dtype)
    folded: dict[str, object] = {}
    for kind, cm in masks.items():
        if isinstance(cm, torch.Tensor) and cm.ndim == 4:
            low = torch.finfo(hidden.dtype).min
            if cm.dtype == torch.bool:
                cm = torch.where(cm, torch.zeros((), device=cm.device, dtype=hidden.dtype), low)
            bias = alibi.reshape(batch, -1, *alibi.shape[1:]) / math.sqrt(int(config.hidden_size) // heads)
            cm = torch.masked_fill(bias, cm < -1, low)
        folded[kind] = cm
    return alibi, folded


def call_layer(
    family: Family,
    layer: torch.nn.Module,
    index: int,
    hidden: torch.Tensor,
    inputs: SpanInputs,
    cache: DynamicCache | None,
) -> torch.Tensor:
    """Layer ``index`` over ``hidden``, called as the family's model calls it; the new hidden states."""
    kind = family.layer_kind(index)
    mask, rotary, pos = inputs.masks[kind], inputs.rotary[kind], inputs.position_ids
    use = cache is not None
    style = family.spec.call
    if style == "decoder":
        fixed = {keyword: inputs.masks[k] for keyword, k in family.spec.mask_keywords}
        fixed.setdefault("attention_mask", mask)
        out = layer(hidden, position_ids=pos, cache=cache, use_cache=use, position_embeddings=rotary, **fixed)
    elif style == "gpt2":
        out = layer(hidden, cache=cache, attention_mask=mask, use_cache=use, position_ids=pos)
    elif style == "neox":
        out = layer(
            hidden, attention_mask=mask, position_ids=pos, layer_past=cache, use_cache=use, position_embeddings=rotary
        )
    elif style == "falcon":
        out = layer(
            hidden,
            alibi=inputs.alibi,
            attention_mask=mask,
            position_ids=pos,
            layer_past=cache,
            use_cache=use,
            position_embeddings=rotary,
        )
    else:  # bloom
        out = layer(hidden, alibi=inputs.alibi, attention_mask=mask, layer_past=cache, use_cache=use)
    result = out[0] if isinstance(out, tuple) else out
    assert isinstance(result, torch.Tensor)
    return result


def run_span(
    family: Family,
    layers: Sequence[torch.nn.Module],
    indices: Sequence[int],
    hidden: torch.Tensor,
    rotary: torch.nn.Module | None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: DynamicCache | None = None,
    past: int = 0,
) -> torch.Tensor:
    """Layers ``indices`` (``layers`` in the same order) over ``hidden``: what a server computes for one call."""
    inputs = span_inputs(
        family,
        rotary,
        hidden,
        indices,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        past=past,
    )
    for layer, index in zip(layers, indices, strict=True):
        hidden = call_layer(family, layer, index, hidden, inputs, cache)
    return hidden
