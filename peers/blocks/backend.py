"""Runs a span of decoder layers: forward with or without a KV cache, and backward."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from peers.blocks.families import Family
from swarm.ids import Span


class SpanBackend:
    def __init__(
        self, config, family: Family, layers: torch.nn.ModuleList, span: Span, device: str, dtype: torch.dtype
    ):
        self.config = config
        self.family = family
        self.layers = layers
        self.span = span
        self.device = torch.device(device)
        self.dtype = dtype
        self.rotary = family.rotary_cls(config).to(self.device)  # weightless: built here, not loaded
        self.sliding = [family.is_sliding(config, i) for i in range(span.start, span.end)]

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def run(
        self,
        hidden: torch.Tensor,
        sub: Span,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        past: int = 0,
    ) -> torch.Tensor:
        """Blocks ``sub`` (inside this span) over ``hidden`` [batch, n, hidden]; ``past`` tokens already cached."""
        hidden = hidden.to(self.device)
        batch, n = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=self.device).unsqueeze(0).expand(batch, -1)
        else:
            position_ids = position_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        position_embeddings = self.rotary(hidden, position_ids)
        local = range(sub.start - self.span.start, sub.end - self.span.start)
        masks = {}
        for kind in {self.sliding[i] for i in local}:
            first = next(i for i in local if self.sliding[i] == kind)
            make = create_sliding_window_causal_mask if kind else create_causal_mask
            masks[kind] = make(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                layer_idx=self.span.start + first,
            )
        for i in local:
            out = self.layers[i](
                hidden,
                attention_mask=masks[self.sliding[i]],
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden
