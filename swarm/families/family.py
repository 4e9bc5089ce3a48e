"""What a family is, as data: a ``FamilySpec`` (one per causal-LM class: a row of ``swarm.families.spec.SPECS``, or
what ``swarm.families.infer`` reads off the class) and a ``Family`` (a spec bound to one config and to the classes
transformers builds for it). Kept apart from ``spec.py`` so the modules that work out a family (``spec``,
``infer``) and those that use one (``span``, ``kv``, ``local``) import it without importing each other."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PretrainedConfig, PreTrainedModel

from swarm.hf_calls import init_weights

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
    norm: str = "norm"  # the final norm, an attribute of the base model ("": none, the head reads the last layer)
    positions: str | None = None  # learned absolute positions added to the embeddings (GPT-2's ``wpe``)
    embed_norm: str | None = None  # a norm right after the embeddings (BLOOM's ``word_embeddings_layernorm``)
    needs_eager: bool = False  # soft-capping, sinks or additive ALiBi masks: sdpa would fail or silently differ
    # the embeddings stage: from the modules the base model holds, or through the model's own forward
    # (``swarm.families.own_forward``); None: not decided yet (an inferred family, until ``family_of`` compares the two)
    embed: Literal["modules", "forward"] | None = "modules"
    head: Literal["modules", "forward"] | None = "modules"  # the head stage, the same way
    base: str | None = None  # the base model's attribute where it is not the class's ``base_model_prefix``
    materialize_mask: bool = False  # Falcon folds ALiBi into a 4D mask: never skip it as "causal"
    # keyword -> layer kind whose mask the model passes under it whatever the layer's own kind (Falcon-H1's layers,
    # "hybrid", take the full mask as ``attention_mask`` and the recurrent one as ``mamba_attention_mask``)
    mask_keywords: tuple[tuple[str, str], ...] = ()
    window_masks: bool = True  # a ``sliding_window`` in the config means sliding masks (Moshi's model never builds any)
    disk_renames: tuple[tuple[str, str], ...] = ()  # on-disk prefix -> module prefix (NeoX: embed_out -> lm_head)
    lora_defaults: tuple[str, ...] = ("q_proj", "v_proj")  # PEFT 0.21's default targets for the family
    refuse: tuple[tuple[str, str], ...] = ()  # (config attribute, why) refused when the attribute is truthy
    inferred: bool = False  # read off the class (``swarm.families.infer``), not a row of ``SPECS``
    layers: str | None = None  # the base model's attribute holding the layers (None: ``layers`` or ``h``)
    # config attributes the model applies around its layers (inferred from the config: Granite's, Cohere's)
    embedding_multiplier: str | None = None  # embeddings x config.<this>
    logits_divisor: str | None = None  # logits / config.<this>
    logits_multiplier: str | None = None  # logits x config.<this>

    @property
    def after_embedding(self) -> str | None:
        """What the model applies to the token embeddings before its first layer (None: nothing). PEFT's input
        prompts pass through it; the swarm prepends prompts after it, so prompt tuning is refused for such families."""
        if self.embed == "forward":
            return "its model's own embeddings stage (run through its forward)"
        if self.positions is not None:
            return f"learned positions ({self.positions!r})"
        if self.embedding_multiplier is not None:
            return f"an embedding multiplier ({self.embedding_multiplier!r})"
        return f"embedding norm ({self.embed_norm!r})" if self.embed_norm is not None else None


# accelerate's ``init_empty_weights`` swaps ``torch.nn.Module.register_parameter`` for the whole process and puts back
# what it found on exit: two threads inside at once (a client's concurrent generations building their first stages)
# can leave the swap in place for good, and every module built afterwards has its weights on meta. One at a time.
_EMPTY_WEIGHTS = threading.Lock()


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Modules built inside get their weights on meta and their buffers computed on CPU (one thread at a time)."""
    from accelerate import init_empty_weights

    with _EMPTY_WEIGHTS, torch.device("cpu"), init_empty_weights(include_buffers=False):
        yield


def rotary_attr(base: torch.nn.Module) -> str | None:
    """The base model's rotary module: ``rotary_emb``, or its one weightless child named a rotary embedding by its
    class (LFM2-MoE's ``pos_emb``); None where it has none."""
    if isinstance(getattr(base, "rotary_emb", None), torch.nn.Module):
        return "rotary_emb"
    found = [
        name
        for name, child in base.named_children()
        if type(child).__name__.endswith("RotaryEmbedding") and not any(True for _ in child.parameters())
    ]
    return found[0] if len(found) == 1 else None


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
    kv_per_kind: tuple[tuple[str, int], ...] = ()  # measured cached elements per token by layer kind (inferred)

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
        windowed = self.spec.window_masks and getattr(self.config, "sliding_window", None) is not None
        return "sliding_attention" if windowed else "full_attention"

    def build_layer(self, index: int) -> torch.nn.Module:
        """Layer ``index`` on the current default device (``meta`` to fill with ``load_state_dict(assign=True)``)."""
        cls = self.layer_classes[index]
        signature = inspect.signature(cls.__init__)
        params = [n for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]
        required = [n for n in params if signature.parameters[n].default is inspect.Parameter.empty]
        if self.spec.inferred or not params or params[0] != "config" or len(required) > 2 or len(params) > 2:
            return self._layer_of_model(index)
        if "layer_idx" in params:
            return cls(self.config, layer_idx=index)
        return cls(self.config, index) if len(params) > 1 else cls(self.config)  # GPT-Neo's ``layer_id``

    def _layer_of_model(self, index: int) -> torch.nn.Module:
        """Layer ``index`` as the model's own constructor builds it, for an inferred family (its model may give its
        layers buffers: Falcon-H1's multipliers) and for layers built from more than the config (Bamba's layer type):
        a copy of the layer of the whole model built once with its weights on meta (no memory) and its buffers on
        CPU; on meta, all of it there; elsewhere, its weights allocated and initialised as the model initialises
        them, its buffers moved there as the constructor computed them."""
        import copy

        model = self._built()
        layer: torch.nn.Module = copy.deepcopy(getattr(model.get_submodule(self.base_prefix), self.layers_attr)[index])
        device = torch.get_default_device()
        if device.type == "meta":
            return layer.to("meta")
        buffers = {n: b.to(device) for n, b in layer.named_buffers()}
        layer.to_empty(device=device)
        for name, buffer in buffers.items():
            path, _, leaf = name.rpartition(".")
            layer.get_submodule(path)._buffers[leaf] = buffer
        with torch.no_grad():
            for module in layer.modules():
                init_weights(model, module)
        return layer

    def layer_buffers(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s buffers as its constructor computes them (on CPU), without allocating its weights."""
        if self.spec.inferred:
            layer = getattr(self._built().get_submodule(self.base_prefix), self.layers_attr)[index]
            return dict(layer.named_buffers())
        with weights_on_meta():
            return dict(self.build_layer(index).named_buffers())

    def _built(self) -> PreTrainedModel:
        """The model, weights on meta and buffers on CPU, built once for this family (every layer, every check)."""
        held = self.__dict__.get("_model_on_meta")
        if held is None:
            with weights_on_meta():
                held = self.__dict__.get("_model_on_meta")  # another thread may have built it meanwhile
                if held is None:
                    held = self.lm_class(self.config)
                    object.__setattr__(self, "_model_on_meta", held)  # a cache on a frozen instance: not a field
        assert isinstance(held, PreTrainedModel)
        return held

    def new_rotary(self, device: torch.device | str) -> torch.nn.Module | None:
        """The rotary module (weightless: built on ``device`` from the config, never loaded)."""
        if self.spec.rotary == "none" or self.rotary_class is None:
            return None
        return self.rotary_class(config=self.config).to(device)
