"""Which family a config belongs to, and what that family is: a ``FamilySpec`` (data, one per causal-LM class) bound
to the config and to the classes transformers builds for it (a ``Family``).

The family is found from ``config.architectures`` (else transformers' own config -> causal-LM mapping), and the layer
and rotary classes are read off the causal-LM class built on the meta device: nothing is looked up by the model
type's name, so ``gemma3_text`` (defined in ``modeling_gemma3``) is found like any other."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PretrainedConfig, PreTrainedModel

from swarm.errors import BadInputError

# How the model calls its decoder layers (transformers 5.24): the keyword the cache goes under, what else they take.
CallStyle = Literal["decoder", "gpt2", "neox", "falcon", "bloom"]
# Rotary tables a span computes: none (learned positions or ALiBi), one for all layers, or one per layer type.
Rotary = Literal["none", "shared", "per_layer_type"]
# How a layer's keys and values are cached (what a token costs): grouped-query heads, hidden-sized (multi-head),
# Falcon's three layouts, or DeepSeek's compressed latent.
KvLayout = Literal["gqa", "hidden", "falcon", "latent"]
# How expert weights are stored on disk versus held by the 5.x module.
Experts = Literal["none", "mixtral", "per_expert", "fused"]


@dataclass(frozen=True)
class FamilySpec:
    label: str  # for messages and the README ("llama", "gemma3_text", ...): never used to find code
    call: CallStyle = "decoder"
    rotary: Rotary = "shared"
    kv: KvLayout = "gqa"
    experts: Experts = "none"
    norm: str = "norm"  # the final norm, an attribute of the base model
    positions: str | None = None  # learned absolute positions added to the embeddings (GPT-2's ``wpe``)
    embed_norm: str | None = None  # a norm right after the embeddings (BLOOM's ``word_embeddings_layernorm``)
    needs_eager: bool = False  # soft-capping, sinks or additive ALiBi masks: sdpa would fail or silently differ
    materialize_mask: bool = False  # Falcon folds ALiBi into a 4D mask: never skip it as "causal"
    disk_renames: tuple[tuple[str, str], ...] = ()  # on-disk prefix -> module prefix (NeoX: embed_out -> lm_head)
    lora_defaults: tuple[str, ...] = ("q_proj", "v_proj")  # PEFT 0.21's default targets for the family
    refuse: tuple[tuple[str, str], ...] = ()  # (config attribute, why) refused when the attribute is truthy

    @property
    def after_embedding(self) -> str | None:
        """What the model applies to the token embeddings before its first layer (None: nothing). PEFT's input
        prompts pass through it; the swarm prepends prompts after it, so prompt tuning is refused for such families."""
        if self.positions is not None:
            return f"learned positions ({self.positions!r})"
        return f"embedding norm ({self.embed_norm!r})" if self.embed_norm is not None else None


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


def spec_of(lm_class: type[PreTrainedModel]) -> FamilySpec:
    spec = SPECS.get(lm_class.__name__)
    if spec is None:
        raise BadInputError(
            f"{lm_class.__name__} (in {lm_class.__module__}) is not a family this swarm serves "
            f"exactly; supported: {', '.join(supported_labels())}"
        )
    return spec


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


@dataclass(frozen=True)
class Family:
    """A family bound to one config: ``config`` is a copy carrying the attention and experts implementations the
    family runs (both server layers and client masks are made from it)."""

    spec: FamilySpec
    lm_class: type[PreTrainedModel]
    config: PretrainedConfig
    base_prefix: str  # "model", "transformer", "gpt_neox"
    layers_attr: str  # "layers" or "h", under the base model
    layer_classes: tuple[type[torch.nn.Module], ...] = field(repr=False)
    rotary_class: type[torch.nn.Module] | None = field(repr=False)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def layers_path(self) -> str:
        return f"{self.base_prefix}.{self.layers_attr}"

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def layer_kind(self, index: int) -> str:
        """``full_attention`` or ``sliding_attention``: which mask (and, per layer type, which rotary) layer
        ``index`` takes; the rule DynamicCache sizes its layers by."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return str(layer_types[index])
        return "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"

    def build_layer(self, index: int) -> torch.nn.Module:
        """Layer ``index`` on the current default device (``meta`` to fill with ``load_state_dict(assign=True)``)."""
        return self.layer_classes[index](self.config, layer_idx=index)

    def new_rotary(self, device: torch.device | str) -> torch.nn.Module | None:
        """The rotary module (weightless: built on ``device`` from the config, never loaded)."""
        if self.spec.rotary == "none" or self.rotary_class is None:
            return None
        return self.rotary_class(config=self.config).to(device)


def family_of(config: PretrainedConfig, spec: FamilySpec | None = None, attn: str | None = None) -> Family:
    """The family of ``config`` (``spec``/``attn``: override what the family layer would choose; tests do, to prove
    that the self-check catches a wrong choice)."""
    lm_class = lm_class_of(config)
    spec = spec or spec_of(lm_class)
    problems = declared_problems(config, spec)
    if problems:
        raise BadInputError(f"{spec.label}: cannot serve this model exactly: {'; '.join(problems)}")
    config = copy.deepcopy(config)
    if spec.needs_eager:
        config._attn_implementation = "eager"
    with torch.device("meta"):
        model = lm_class(config)  # resolves the attention and experts implementations into ``config``
    if attn is not None:  # after the class's own checks, as a server that forced it on its layers would
        config._attn_implementation = attn
    base = getattr(model, lm_class.base_model_prefix)
    attr = next((a for a in ("layers", "h") if isinstance(getattr(base, a, None), torch.nn.ModuleList)), None)
    if attr is None:
        raise BadInputError(f"{lm_class.__name__}: no decoder layers found under {lm_class.base_model_prefix}")
    layers = getattr(base, attr)
    rotary = getattr(base, "rotary_emb", None)
    return Family(
        spec=spec,
        lm_class=lm_class,
        config=config,
        base_prefix=lm_class.base_model_prefix,
        layers_attr=attr,
        layer_classes=tuple(type(layer) for layer in layers),
        rotary_class=type(rotary) if rotary is not None else None,
    )
