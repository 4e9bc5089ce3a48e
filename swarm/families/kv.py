"""KV-cache bytes per token, per family and per layer: what a server's cache budget is counted in.

Per token and layer a cache holds keys and values of: ``2 * kv_heads * head_dim`` elements for grouped-query layers;
``2 * hidden`` for the multi-head families (GPT-2, BLOOM, GPT-NeoX); for Falcon ``2 * head_dim`` (multi-query),
``2 * heads * head_dim`` (the new decoder architecture: transformers caches keys and values broadcast to every
query head) or ``2 * hidden``; and for DeepSeek-V3's multi-head latent attention the compressed latent and the
rotary key, ``kv_lora_rank + qk_rope_head_dim`` (not GQA heads). Sliding-window layers keep at most
``sliding_window - 1`` tokens once a step is over (transformers' ``DynamicSlidingWindowLayer``)."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PretrainedConfig

from swarm.families.spec import Family


def _head_dim(config: PretrainedConfig) -> int:
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size) // int(config.num_attention_heads)


def elements_per_token(family: Family, index: int) -> int:
    """Cached elements (keys and values together) per token of layer ``index``."""
    measured = dict(family.kv_per_kind)  # an inferred family: what its layers were seen to cache
    if measured:
        return measured[family.layer_kind(index)]
    config, kv = family.config, family.spec.kv
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    if kv == "latent":
        return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    if kv == "hidden":
        return 2 * hidden
    if kv == "falcon":
        head_dim = hidden // heads
        if getattr(config, "new_decoder_architecture", False):
            return 2 * heads * head_dim
        return 2 * head_dim if getattr(config, "multi_query", False) else 2 * hidden
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return 2 * kv_heads * _head_dim(config)


def tokens_kept(family: Family, index: int, context: int) -> int:
    """Tokens layer ``index`` keeps after a context of ``context`` tokens."""
    if family.layer_kind(index) == "sliding_attention":
        window = int(family.config.sliding_window)
        return min(context, window - 1)
    return context


def cache_bytes(family: Family, indices: Iterable[int], context: int, dtype_bytes: int, batch: int = 1) -> int:
    """Bytes the caches of layers ``indices`` hold for ``batch`` sequences of ``context`` tokens."""
    per = sum(elements_per_token(family, i) * tokens_kept(family, i, context) for i in indices)
    return per * dtype_bytes * batch


def bytes_per_token(family: Family, indices: Iterable[int], dtype_bytes: int) -> int:
    """Bytes one more token costs in the caches of ``indices`` at long contexts (sliding layers cost nothing more:
    their window is paid once, see ``window_bytes``)."""
    return (
        sum(elements_per_token(family, i) for i in indices if family.layer_kind(i) != "sliding_attention") * dtype_bytes
    )


def window_bytes(family: Family, indices: Iterable[int], dtype_bytes: int) -> int:
    """Bytes the sliding layers of ``indices`` hold at most, per sequence."""
    return (
        sum(
            elements_per_token(family, i) * (int(family.config.sliding_window) - 1)
            for i in indices
            if family.layer_kind(i) == "sliding_attention"
        )
        * dtype_bytes
    )


def tokens_within(family: Family, indices: Iterable[int], dtype_bytes: int, budget: int, batch: int = 1) -> int:
    """The longest context whose caches for layers ``indices`` fit in ``budget`` bytes for ``batch`` sequences
    (caches grow with the context, so a bisection finds it; sliding windows make the growth slower, not smaller)."""
    layers = list(indices)
    if not layers or cache_bytes(family, layers, 1, dtype_bytes, batch) == 0:
        return 0 if not layers else budget
    low, high = 0, 1
    while cache_bytes(family, layers, high, dtype_bytes, batch) <= budget:
        low, high = high, high * 2
        if high > 1 << 40:  # only sliding layers: every context fits once the windows do
            return 1 << 40
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cache_bytes(family, layers, mid, dtype_bytes, batch) <= budget else (low, mid)
    return low
