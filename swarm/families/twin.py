"""The self-check's twin of a config: the same class and family settings (layer types, partial rotary, ALiBi,
soft-caps, sinks, latent attention, experts) at a size that runs in well under a second."""

from __future__ import annotations

import copy
import dataclasses

from transformers import PretrainedConfig

from swarm.families.family import Family

VOCAB, HIDDEN, LAYERS = 320, 64, 4
_SIZES = {  # attribute -> twin value, set only where the config has the attribute (and it is not None)
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 8,
    "vocab_size": VOCAB,
}


def _set(config: PretrainedConfig, key: str, value: object) -> None:
    """Set ``key`` on the twin where the config lets it (a derived attribute is a property without a setter)."""
    try:
        setattr(config, key, value)
    except (AttributeError, TypeError, ValueError):
        pass


def shrink(config: PretrainedConfig) -> PretrainedConfig:
    """A small twin of ``config`` with the same family settings: 4 layers repeating its layer types, hidden 64."""
    twin = copy.deepcopy(config)
    kinds: list[str] = []
    layer_types = getattr(config, "layer_types", None)
    for kind in layer_types or []:
        if kind not in kinds:
            kinds.append(kind)
    for key, value in _SIZES.items():
        if getattr(config, key, None) is not None:
            _set(twin, key, value)
    heads, kv = int(getattr(config, "num_attention_heads", 0) or 0), getattr(config, "num_key_value_heads", None)
    if kv is not None:  # keep multi-head, grouped or multi-query as it was
        _set(twin, "num_key_value_heads", 4 if int(kv) == heads else (1 if int(kv) == 1 else 2))
    if getattr(config, "num_kv_heads", None) is not None:  # Falcon
        _set(
            twin,
            "num_kv_heads",
            4 if int(config.num_kv_heads) == heads else (1 if int(config.num_kv_heads) == 1 else 2),
        )
    if getattr(config, "head_dim", None) is not None and not isinstance(
        type(config).__dict__.get("head_dim"), property
    ):
        _set(twin, "head_dim", 8 if getattr(config, "kv_lora_rank", None) is not None else 16)
    if getattr(config, "rotary_dim", None):  # GPT-J's rotary width: within the twin's heads of 16
        _set(twin, "rotary_dim", 8)
    if getattr(config, "num_experts_per_tok", None) is not None:
        _set(twin, "num_experts_per_tok", min(int(config.num_experts_per_tok), 2))
    if getattr(config, "n_shared_experts", None):
        _set(twin, "n_shared_experts", 1)
    if getattr(config, "first_k_dense_replace", None):
        _set(twin, "first_k_dense_replace", 1)
    if getattr(config, "mlp_only_layers", None):
        _set(twin, "mlp_only_layers", [0])
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    _set(twin, "num_hidden_layers", LAYERS)
    for key, value in vars(config).items():  # a layer pattern by period (Jamba's attention every 8th layer from the
        # 4th): every 2nd within the twin's 4 layers, so each kind of layer is still there
        offset = vars(config).get(key.replace("_period", "_offset"))
        if key.endswith("_period") and isinstance(value, int) and isinstance(offset, int) and value > 2:
            _set(twin, key, 2)
            _set(twin, key.replace("_period", "_offset"), offset % 2)
    if layer_types:
        _set(twin, "layer_types", [kinds[i % len(kinds)] for i in range(LAYERS)])
    for key, value in vars(config).items():  # other per-layer lists (``mlp_layer_types``): their pattern, 4 long
        if key != "layer_types" and isinstance(value, list) and layers > LAYERS and len(value) == layers:
            pattern = list(dict.fromkeys(value)) if all(isinstance(v, str) for v in value) else value
            _set(twin, key, [pattern[i % len(pattern)] for i in range(LAYERS)])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token: object = getattr(config, key, None)
        if isinstance(token, int) and token >= VOCAB:
            _set(twin, key, 0)
        elif isinstance(token, list):
            _set(twin, key, [v if v < VOCAB else 0 for v in token])
    _set(twin, "_attn_implementation", getattr(config, "_attn_implementation_internal", None))
    return twin


def twin_of(family: Family) -> Family:
    """``family`` bound to the shrunk twin of its config (same class, layers and spec)."""
    return dataclasses.replace(family, config=shrink(family.config), kv_per_kind=())
