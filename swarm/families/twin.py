"""The self-check's twin of a config: the same class and family settings (layer types, partial rotary, ALiBi,
soft-caps, sinks, latent attention, experts) at a size that runs in well under a second."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

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
    "mamba_d_state": 16,  # state-space state widths: the twin's run time grows with them
    "ssm_state_size": 16,
    "state_size": 16,
    "linear_head_dim": 16,  # linear attention's heads (Kimi-Linear's): the same
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
    for key, value in vars(config).items():  # layer indices (Bamba's attention layers): spread over the twin's 4
        if "layer" in key and _indices(value, layers) and layers > LAYERS and key != "mlp_only_layers":
            _set(twin, key, _spread(value, layers))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token: object = getattr(config, key, None)
        if isinstance(token, int) and token >= VOCAB:
            _set(twin, key, 0)
        elif isinstance(token, list):
            _set(twin, key, [v if v < VOCAB else 0 for v in token])
    _mamba_heads(config, twin)
    _follow_derived(config, twin)
    _set(twin, "_attn_implementation", getattr(config, "_attn_implementation_internal", None))
    return twin


def _indices(value: object, layers: int) -> bool:
    return (  # not a per-layer list (one entry a layer: Llama-4's ``no_rope_layers`` flags), set as those above
        isinstance(value, list) and 0 < len(value) < layers and all(type(v) is int and 0 <= v < layers for v in value)
    )


def _spread(value: list[int], layers: int) -> list[int]:
    """Layer indices of a ``layers``-deep model at the same relative depths of the twin's, one layer kept out of the
    set where the set does not hold every layer (both kinds stay)."""
    spread = sorted({min(LAYERS - 1, v * LAYERS // layers) for v in value})
    if len(value) < layers and len(spread) == LAYERS:
        spread = spread[1:]
    return spread


# State-space mixers (Mamba-2 and the hybrids around it) split ``expand * hidden`` into heads: (heads, head width,
# expansion) under each spelling transformers uses. The twin keeps the product: 8 heads over the twin's width.
_MAMBA_HEADS = (
    ("num_heads", "head_dim", "expand"),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba_num_heads", "mamba_head_dim", "expand"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
)


def _mamba_heads(config: PretrainedConfig, twin: PretrainedConfig) -> None:
    hidden = getattr(config, "hidden_size", None)
    for heads, width, expand in _MAMBA_HEADS:
        values = [vars(config).get(k) for k in (heads, width, expand)]
        numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(numbers) != len(values) or hidden is None:
            continue
        n, d, e = numbers
        ssm = vars(config).get("mamba_d_ssm")  # Falcon-H1's mixer width, set apart from the expansion
        if int(n) * int(d) != (int(ssm) if isinstance(ssm, int) else int(e * int(hidden))):  # attention heads
            continue
        n_twin = min(int(n), 8)
        _set(twin, heads, n_twin)
        _set(twin, width, (128 if isinstance(ssm, int) else int(e * HIDDEN)) // n_twin)
        if isinstance(ssm, int):
            _set(twin, "mamba_d_ssm", 128)


def _follow_derived(config: PretrainedConfig, twin: PretrainedConfig) -> None:
    """Sizes the config class derives in its constructor from those the twin changes (Zamba's head widths and hybrid
    layer ids, a Mamba rank from the hidden size) take the values the class's own rules give at the twin's sizes: the
    config rebuilt from its values with and without the twin's changes, and whatever else differs follows."""
    cls = type(config)
    held = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    # the class's own fields; what else the config holds its constructor set (and a keyword would override it)
    own = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(held)
    fields = {k: v for k, v in held.items() if k in own}
    changed = {k: v for k, v in vars(twin).items() if k in fields and fields[k] != v}
    if not changed:
        return
    try:
        # sizes left unset ("auto" or None) that the class fills from others (Zamba's attention width, twice the
        # hidden size): those the class gives the same value for when they are unset again
        unset = {
            f.name: f.default
            for f in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())
            if f.default in (None, "auto") and f.name not in changed and isinstance(fields.get(f.name), int | float)
        }
        filled = vars(_build(cls, {**fields, **unset}))
        derived = {k: v for k, v in unset.items() if filled.get(k) == fields[k]}
        before, after = _build(cls, fields), _build(cls, {**fields, **changed, **derived})
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt from its own values: the twin as set
        return
    for key, value in vars(after).items():
        if key in changed or key.startswith("_") or key not in held:
            continue
        if vars(before).get(key) != value or key in derived:
            _set(twin, key, value)


def _build(cls: type[PretrainedConfig], values: dict[str, object]) -> PretrainedConfig:
    build: Callable[..., PretrainedConfig] = cls  # a config class takes its own values as keywords
    return build(**copy.deepcopy(values))  # its own copies: constructors write into sub-configs (DBRX's experts')


def twin_of(family: Family) -> Family:
    """``family`` bound to the shrunk twin of its config (same class, layers and spec)."""
    return dataclasses.replace(family, config=shrink(family.config), kv_per_kind=())
