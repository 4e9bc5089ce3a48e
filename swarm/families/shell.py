"""The family's causal-LM class without its decoder layers (the client's local parts, and the shell the stages run
through the model's own forward are built in): built on the meta device (no memory: tensors are assigned when
loaded). Its non-persistent buffers (Gemma's ``embed_scale``; rotary tables the client never uses) are not in any
checkpoint, so ``restore_buffers`` takes them from the same class built for real with a tiny vocabulary: left on
meta they would crash, left empty they would silently scale embeddings by garbage."""

from __future__ import annotations

import copy
import weakref

import torch
from transformers import PretrainedConfig, PreTrainedModel

from swarm.families.family import Family
from swarm.hf_calls import output_embeddings


def _zero_layers(config: PretrainedConfig) -> PretrainedConfig:
    config = copy.deepcopy(config)
    config.num_hidden_layers = 0
    config._attn_implementation = None  # no attention runs here: the class's own default, never a refused one
    if getattr(config, "layer_types", None) is not None:
        try:
            config.layer_types = []
        except AttributeError:  # derived from other fields (Jamba's): it follows the layer count by itself
            pass
    return config


# A local model's modules with weights beside its base model and head (ModernBERT-decoder's prediction head), by
# its base model: the head stage run through the model's own forward (``stage``) is given only base and head.
_BESIDE: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = weakref.WeakKeyDictionary()


def local_model(family: Family, device: str | torch.device = "cpu") -> PreTrainedModel:
    """The family's causal LM without decoder layers: embeddings, final norm and head. On ``meta`` as built; on a
    real device with its parameters uninitialised (fill them with ``load_local``) and its buffers restored."""
    with torch.device("meta"):
        model = family.lm_class(_zero_layers(family.config))
    model.train(False)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        restore_buffers(family, base_of(family, model))
    top = family.base_prefix.split(".")[0]
    head = head_of(model)
    beside = {
        n: c for n, c in model.named_children() if n != top and c is not head and any(True for _ in c.parameters())
    }
    if beside:
        _BESIDE[base_of(family, model)] = beside
    return model


def beside_of(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules with weights its local model holds beside ``base`` and its head (none for most families)."""
    return dict(_BESIDE.get(base, {}))


def restore_buffers(family: Family, base: PreTrainedModel) -> None:
    """Give ``base``'s non-persistent buffers their values, computed by the class itself (on a tiny-vocabulary twin:
    no buffer depends on the vocabulary), on the device of ``base``'s embeddings."""
    small = _zero_layers(family.config)
    small.vocab_size = 8
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(small, key):
            try:
                setattr(small, key, None)
            except Exception:  # noqa: BLE001 - a strict config (its own validation error types) that wants a token id:
                setattr(small, key, 0)  # one inside the tiny vocabulary
    with torch.device("cpu"):
        try:
            twin = base_of(family, family.lm_class(small))
        except ZeroDivisionError:  # an initialiser that divides by the layer count (ModernBERT-decoder's): the
            # weights are thrown away, the buffers come from the modules' constructors, which do not initialise
            from transformers.initialization import no_init_weights

            with no_init_weights():
                twin = base_of(family, family.lm_class(small))
    persistent = set(base.state_dict())
    weight = _embedding_weight(base)
    for name, value in twin.named_buffers():
        if name in persistent:
            continue
        path, _, leaf = name.rpartition(".")
        owner = base.get_submodule(path)
        owner._buffers[leaf] = value.to(weight.device if not weight.is_meta else "cpu")  # in the class's own dtype


def base_of(family: Family, model: torch.nn.Module) -> PreTrainedModel:
    """The base model (embeddings and final norm) of a causal LM of the family."""
    base = model.get_submodule(family.base_prefix)
    assert isinstance(base, PreTrainedModel)
    return base


def head_name(model: PreTrainedModel) -> str:
    """Where the LM head lives: the class's output embeddings (``lm_head`` in most families; NeoX's ``embed_out`` is
    renamed on load; BioGPT's ``output_projection``)."""
    head = output_embeddings(model)
    found = next((n for n, m in model.named_modules() if m is head and n), None) if head is not None else None
    return found or "lm_head"


def head_of(model: PreTrainedModel) -> torch.nn.Module:
    """The LM head (``head_name``)."""
    return model.get_submodule(head_name(model))


def _embedding_weight(model: PreTrainedModel) -> torch.Tensor:
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight
