"""Which of the installed transformers' decoder-only causal-LM architectures the swarm serves exactly, and why the
others are refused.

    python scripts/family_coverage.py                 # the table, then the counts and the refusals grouped
    python scripts/family_coverage.py --json out.json

For each causal-LM class transformers maps a config to (one row per class), a tiny random config from the config
class's defaults: the self-check's shrunk twin (``swarm.families.selfcheck``: hidden 64, 4 layers), with every
multiplier or scale the defaults leave at 1.0 moved to 0.75 (a model that multiplies its embeddings or logits by
one would pass without the split path knowing it does). Then:
1. the self-check (full pass, padded batch, prefill plus cached steps, through two spans), which decides;
2. for those it serves, the real split execution (``selfcheck.saved_diff``): the tiny model saved to disk with
   perturbed weights, its layers read back by the server's loader and run as two spans with their own caches, the
   span path the server's runtime runs, its embeddings and head loaded as the client loads them, a prefill and
   cached steps on a left-padded batch compared with Hugging Face's logits (fp32, tolerance 1e-4).

Not counted as decoder-only causal LMs: encoders that can act as decoders (a masked-LM class exists for the model
type: BERT and kin), decoders of encoder-decoder models (a sequence-to-sequence class exists: BART, Marian, ...),
and composite configs (a text model inside a vision or audio one; their text models are rows of their own)."""

from __future__ import annotations

import argparse
import collections
import json
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TOLERANCE = 1e-4


@dataclass
class Row:
    model_type: str
    lm_class: str
    served: bool
    why: str = ""  # the refusal, or the largest difference of the real split execution
    split_diff: float | None = None


def architectures() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(model type, causal-LM class) of every decoder-only architecture, one per class; and what was left out, why."""
    from transformers.models.auto import modeling_auto as ma

    masked, s2s = set(ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES), set(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    seen: dict[str, list[str]] = {}
    left: dict[str, str] = {}
    for model_type, name in sorted(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        name = name[0] if isinstance(name, list | tuple) else name
        if model_type in masked:
            left[model_type] = "an encoder (it has a masked-LM class)"
        elif model_type in s2s:
            left[model_type] = "the decoder of an encoder-decoder model"
        elif _composite(model_type):
            left[model_type] = "a composite (vision or audio) config"
        else:
            seen.setdefault(name, []).append(model_type)
    return sorted((_owner(name, types), name) for name, types in seen.items()), left


def _owner(lm_class: str, model_types: list[str]) -> str:
    """The model type whose config class is the class's own (Llama's, not EXAONE's, which maps to it too)."""
    import transformers
    from transformers import CONFIG_MAPPING

    config_class = getattr(getattr(transformers, lm_class, None), "config_class", None)
    return next((t for t in model_types if CONFIG_MAPPING[t] is config_class), model_types[0])


def _composite(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - a config that cannot be built is a row (refused), not left out
        return False
    return bool(getattr(config, "is_encoder_decoder", False)) or any(
        k in (getattr(type(config), "sub_configs", None) or {}) for k in ("text_config", "vision_config")
    )


# Sizes every checkpoint of a class sets, which some config classes leave None by default (Ministral's head_dim,
# Nemotron's KV heads, Dots1's experts): the walk fills them as a checkpoint would, then the twin shrinks them.
_CHECKPOINT_SIZES = {
    "head_dim": lambda c: int(c.hidden_size) // int(c.num_attention_heads),
    "num_key_value_heads": lambda c: int(c.num_attention_heads),
    "n_routed_experts": lambda c: 8,
    "num_experts_per_tok": lambda c: 2,
    "n_shared_experts": lambda c: 1,
}


def _with_attention(config) -> None:
    """A hybrid whose defaults hold no attention layer at all (Bamba's, Granite-4.0-H's: Hugging Face's own forward
    fails on them, its masks need one) gets one every 4th layer from the 4th, as its checkpoints have."""
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    if "attn_layer_indices" in vars(config) and config.attn_layer_indices is None:
        config.attn_layer_indices = [i for i in range(n) if i % 4 == 3]
    kinds = vars(config).get("layer_types") or vars(config).get("layers_block_type")
    if isinstance(kinds, list) and kinds and set(kinds) == {"linear_attention"}:
        key = "layer_types" if "layer_types" in vars(config) else "layers_block_type"
        setattr(config, key, ["full_attention" if i % 4 == 3 else k for i, k in enumerate(kinds)])


def _rope_per_layer_type(config) -> None:
    theta = float(getattr(config, "rope_theta", None) or 10000.0)
    config.rope_parameters = {k: {"rope_type": "default", "rope_theta": theta} for k in set(config.layer_types)}


def _qsa_indexer(config) -> None:
    config.indexer_n_heads, config.indexer_kv_heads, config.indexer_head_dim = 4, 1, int(config.head_dim)
    config.indexer_budget, config.indexer_compress_ratio = 8, 4


# What the published checkpoints of a class set that its defaults leave unset, where Hugging Face's own code fails
# on the defaults: LFM2-MoE's layer pattern (convolutions, attention every 4th), DBRX's rotary base and clipping in its
# attention config, Cohere Compass's rotary per layer type, Qwen4-Exp's token indexer for its indexed layers.
_CHECKPOINT_FILLS = {
    "lfm2_moe": lambda c: setattr(
        c, "layer_types", ["full_attention" if i % 4 == 3 else "conv" for i in range(c.num_hidden_layers)]
    ),
    "dbrx": lambda c: (
        setattr(c.attn_config, "rope_theta", c.rope_parameters["rope_theta"]),
        setattr(c.attn_config, "clip_qkv", c.attn_config.clip_qkv or 8.0),
    ),
    "cohere_compass_text": lambda c: not c.rope_parameters and _rope_per_layer_type(c),
    "qwen4_exp_text": lambda c: c.indexer_n_heads is None and _qsa_indexer(c),
}


def default_config(model_type: str):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and value == 1.0 and re.search(r"multiplier|scale|scaling", key):
            setattr(config, key, 0.75)
    _with_attention(config)
    if model_type in _CHECKPOINT_FILLS:
        _CHECKPOINT_FILLS[model_type](config)
    for key, size in _CHECKPOINT_SIZES.items():
        if key in vars(config) and vars(config)[key] is None:
            try:
                setattr(config, key, size(config))
            except Exception:  # noqa: BLE001 - a config without the sizes this derives from keeps its None
                pass
    return config


def check(model_type: str, lm_class: str) -> Row:
    from swarm.errors import BadInputError
    from swarm.families.selfcheck import check_split, saved_diff

    try:
        config = default_config(model_type)
    except Exception as e:  # noqa: BLE001
        return Row(model_type, lm_class, False, f"its default config cannot be built: {type(e).__name__}: {e}")
    report = check_split(config)
    if not report.ok:
        return Row(model_type, lm_class, False, report.problems[0])
    try:
        diff = saved_diff(config)
    except Exception as e:  # noqa: BLE001 - the twin passed, its saved weights did not (``require_exact`` refuses an
        # inferred family for this with ``check_saved``; the walk asks it of every family)
        why = str(e) if isinstance(e, BadInputError) else f"{type(e).__name__}: {e}"
        return Row(model_type, lm_class, False, f"real split execution failed: {why}")
    ok = diff <= TOLERANCE
    return Row(model_type, lm_class, ok, "" if ok else f"real split execution off by {diff:.1e}", diff)


def walk() -> tuple[list[Row], dict[str, str]]:
    rows = []
    found, left = architectures()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, lm_class in found:
            with torch.random.fork_rng(devices=[]):
                rows.append(check(model_type, lm_class))
    return rows, left


def _reason(why: str) -> str:
    """A refusal's kind, for grouping (the class names and numbers in it taken out)."""
    why = re.sub(r"^\w+(ForCausalLM|LMHeadModel|Model)\b:? ?", "", why)
    why = re.sub(r"off by [0-9.e+-]+", "off by ...", why)
    why = re.sub(r"\(first at block \d+ \([^)]*\)\)", "(first at a block)", why)
    return why[:110]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import transformers

    rows, left = walk()
    print("| model type | class | served | refusal |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.model_type} | {r.lm_class} | {'yes' if r.served else 'no'} | {r.why[:160]} |")
    served = sum(r.served for r in rows)
    print(
        f"\ntransformers {transformers.__version__}: {len(rows)} decoder-only causal-LM architectures, "
        f"{served} served exactly ({100 * served / max(len(rows), 1):.0f}%), {len(rows) - served} refused; "
        f"{len(left)} model types left out (encoders, decoders of encoder-decoders, composites)"
    )
    for reason, n in collections.Counter(_reason(r.why) for r in rows if not r.served).most_common():
        print(f"  {n:3d}  {reason}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "left_out": left}, indent=1))


if __name__ == "__main__":
    main()
