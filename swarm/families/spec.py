"""Which family a config belongs to, and what that family is: a ``FamilySpec`` (data, one per causal-LM class) bound
to the config and to the classes transformers builds for it (a ``Family``).

The family is found from ``config.architectures`` (else transformers' own config -> causal-LM mapping), and the layer
and rotary classes are read off the causal-LM class built on the meta device: nothing is looked up by the model
type's name, so ``gemma3_text`` (defined in ``modeling_gemma3``) is found like any other."""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import PretrainedConfig, PreTrainedModel

from swarm.errors import BadInputError
from swarm.families.family import CallStyle, Experts, Family, FamilySpec, KvLayout, Rotary, rotary_attr

__all__ = ["SPECS", "CallStyle", "Experts", "Family", "FamilySpec", "KvLayout", "Rotary", "family_of"]

_LLAMA_LIKE = FamilySpec("llama")
SPECS: dict[str, FamilySpec] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": FamilySpec("mistral"),
    "Qwen2ForCausalLM": FamilySpec("qwen2"),
    "Qwen3ForCausalLM": FamilySpec("qwen3"),
    "MixtralForCausalLM": FamilySpec("mixtral", experts="mixtral"),
    "Qwen3MoeForCausalLM": FamilySpec("qwen3_moe", experts="per_expert", lora_defaults=("q_proj", "v_proj")),
    "DeepseekV3ForCausalLM": FamilySpec(
        "deepseek_v3", experts="per_expert", kv="latent", lora_defaults=("kv_b_proj", "o_proj")
    ),
    "GptOssForCausalLM": FamilySpec("gpt_oss", experts="fused", needs_eager=True),
    "Gemma2ForCausalLM": FamilySpec("gemma2", needs_eager=True),
    "Gemma3ForCausalLM": FamilySpec(
        "gemma3_text",
        rotary="per_layer_type",
        refuse=(("use_bidirectional_attention", "bidirectional attention (an embedding model, not a causal LM)"),),
    ),
    "GPT2LMHeadModel": FamilySpec(
        "gpt2",
        call="gpt2",
        rotary="none",
        kv="hidden",
        norm="ln_f",
        positions="wpe",
        lora_defaults=("c_attn",),
        refuse=(("add_cross_attention", "cross-attention layers (an encoder-decoder GPT-2)"),),
    ),
    "GPTNeoXForCausalLM": FamilySpec(
        "gpt_neox",
        call="neox",
        kv="hidden",
        norm="final_layer_norm",
        disk_renames=(("embed_out.", "lm_head."),),
        lora_defaults=("query_key_value",),
    ),
    "FalconForCausalLM": FamilySpec(
        "falcon", call="falcon", kv="falcon", norm="ln_f", materialize_mask=True, lora_defaults=("query_key_value",)
    ),
    "BloomForCausalLM": FamilySpec(
        "bloom",
        call="bloom",
        rotary="none",
        kv="hidden",
        norm="ln_f",
        embed_norm="word_embeddings_layernorm",
        needs_eager=True,
        lora_defaults=("query_key_value",),
    ),
}


def supported_labels() -> list[str]:
    return sorted({s.label for s in SPECS.values()})


def lm_class_of(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal-LM class of ``config``: its declared architecture, else transformers' mapping for its config class."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    declared = list(getattr(config, "architectures", None) or [])
    if declared:
        found = getattr(transformers, declared[0], None)
        if not (isinstance(found, type) and issubclass(found, PreTrainedModel)):
            raise BadInputError(
                f"architecture {declared[0]!r} is not a class transformers {transformers.__version__} "
                f"knows; supported families: {', '.join(supported_labels())}"
            )
        return found
    mapped: object = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if isinstance(mapped, tuple):
        mapped = mapped[0]
    if not (isinstance(mapped, type) and issubclass(mapped, PreTrainedModel)):
        raise BadInputError(
            f"{type(config).__name__} has no causal-LM class in transformers; supported "
            f"families: {', '.join(supported_labels())}"
        )
    return mapped


def declared_problems(config: PretrainedConfig, spec: FamilySpec) -> list[str]:
    """What the family layer says it cannot serve exactly in this config, as sentences (empty: nothing)."""
    problems = []
    if getattr(config, "quantization_config", None):
        quant = config.quantization_config
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        problems.append(f"quantized weights ({method}): dequantize the checkpoint first")
    for attr, why in spec.refuse:
        if getattr(config, attr, False):
            problems.append(f"{attr}: {why}")
    return problems


def family_of(config: PretrainedConfig, spec: FamilySpec | None = None, attn: str | None = None) -> Family:
    """The family of ``config`` (``spec``/``attn``: override what the family layer would choose; tests do, to prove
    that the self-check catches a wrong choice)."""
    lm_class = lm_class_of(config)
    spec = spec or SPECS.get(lm_class.__name__)  # None: not a row of the table, inferred from the class below
    label = spec.label if spec is not None else str(getattr(config, "model_type", lm_class.__name__))
    problems = declared_problems(config, spec or FamilySpec(label))
    if problems:
        raise BadInputError(f"{label}: cannot serve this model exactly: {'; '.join(problems)}")
    config = copy.deepcopy(config)
    if spec is not None and spec.needs_eager:
        config._attn_implementation = "eager"
    try:
        with torch.device("meta"):
            model = lm_class(config)  # resolves the attention and experts implementations into ``config``
    except Exception as e:  # transformers' own code refusing this config: a refusal with its reason, not a crash
        raise BadInputError(f"{lm_class.__name__} cannot be built from this config: {type(e).__name__}: {e}") from None
    if spec is None:  # what its modules and signatures tell, a hypothesis the self-check proves or refuses
        from swarm.families.infer import infer_spec

        spec = infer_spec(lm_class, config, model)
    if attn is not None:  # after the class's own checks, as a server that forced it on its layers would
        config._attn_implementation = attn
    base_prefix = spec.base or lm_class.base_model_prefix
    base = model.get_submodule(base_prefix)
    attr = spec.layers or next(
        (a for a in ("layers", "h") if isinstance(getattr(base, a, None), torch.nn.ModuleList)), None
    )
    if attr is None:
        raise BadInputError(f"{lm_class.__name__}: no decoder layers found under {base_prefix}")
    layers = getattr(base, attr)
    named = rotary_attr(base)
    rotary = getattr(base, named) if named is not None else None
    family = Family(
        spec=spec,
        lm_class=lm_class,
        config=config,
        base_prefix=base_prefix,
        layers_attr=attr,
        layer_classes=tuple(type(layer) for layer in layers),
        rotary_class=type(rotary) if isinstance(rotary, torch.nn.Module) else None,
    )
    if spec.inferred:
        from swarm.families.infer import measure_kv

        family = dataclasses.replace(family, kv_per_kind=measure_kv(family))
    if spec.embed is None or spec.head is None:  # inferred: the modules' way, or the model's own where it differs
        from swarm.families.choose import decide

        family = decide(family)
    return family
