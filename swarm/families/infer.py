"""A family read off the causal-LM class itself, for the architectures the table of named families
(``swarm.families.spec.SPECS``) does not list: what the split path needs is found in the model transformers builds on
the meta device, never looked up by name, and whatever is inferred is only a hypothesis that the self-check
(``swarm.families.selfcheck``) proves or refuses.

What is read, and where from:
- the decoder layers: the one ``ModuleList`` directly under the base model (the list its forward iterates);
- how a layer is called: its forward's signature. A layer that takes its cache as ``cache`` is called as Llama's
  model calls it (masks, positions, rotary tables, cache); one that takes ``layer_past`` as GPT-NeoX's. A layer that
  needs an input without a default beyond its hidden states (MPT's ``position_bias``, Zamba's original hidden
  states) needs something its model computes around the layers that this layer cannot know: refused with the names;
- rotary tables: the base model's ``rotary_emb`` (per layer type when its forward takes a layer type);
- the embeddings stage: the base model's input embeddings (scaling inside the module, as Gemma's), plus learned
  positions when the base model holds a second embedding table;
- the head stage: the base model's one remaining module with weights, as the final norm (none: the head reads the
  last layer's output), the LM head (tied or not, by the config), and ``final_logit_softcapping``;
- masks: built in full where the base model's forward turns off transformers' "plain causal" shortcut;
- the KV bytes per token: measured by running one layer of the real config on the meta device (no memory) and
  reading what it put in its cache (``measure_kv``).

Inferred families run the attention their class picks by itself, as Hugging Face's own model of them does: rows
that only padding fills (left-padded batches) then come out as Hugging Face's do, which gradients through them see."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import re
from pathlib import Path

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from swarm.errors import BadInputError
from swarm.families.family import CallStyle, Experts, Family, FamilySpec, Rotary, rotary_attr

_CALLS: dict[str, CallStyle] = {
    "cache": "decoder",
    "layer_past": "neox",
}  # the cache keyword -> the call style that passes it
_PASSED = {"attention_mask", "position_ids", "position_embeddings", "use_cache", *_CALLS}  # what those styles pass
_LAYER_LISTS = ("layers", "h", "blocks")  # the usual names, for a base model that holds other lists too
_LORA_NAMES = ("q_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack")


def _layers(lm_class: type[PreTrainedModel], base: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    lists = [(name, child) for name, child in base.named_children() if isinstance(child, torch.nn.ModuleList)]
    if len(lists) > 1:  # beside rotary modules per layer type (Granite-SWA's ``rotary_embs``), say
        lists = [(name, child) for name, child in lists if name in _LAYER_LISTS] or lists
    if len(lists) != 1 or not len(lists[0][1]):
        found = ", ".join(name for name, _ in lists) or "none"
        nested = [n for n, c in base.named_children() if any(isinstance(g, torch.nn.ModuleList) for g in c.children())]
        where = f" (they are nested under {', '.join(nested)})" if nested and not lists else ""
        raise BadInputError(
            f"{lm_class.__name__}: no single list of decoder layers under its base model{where}: {found}"
        )
    layers = lists[0][1]
    assert isinstance(layers, torch.nn.ModuleList)
    return lists[0][0], layers


def _base_attr(lm_class: type[PreTrainedModel], model: torch.nn.Module) -> str:
    """The attribute holding the base model: the class's ``base_model_prefix``, or else its one child that is a
    model of its own (Llama-4's text model names its prefix ``language_model`` and holds ``model``)."""
    if isinstance(getattr(model, lm_class.base_model_prefix, None), torch.nn.Module):
        found = lm_class.base_model_prefix
    else:
        models = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
        if len(models) != 1:
            raise BadInputError(f"{lm_class.__name__} has no base model under {lm_class.base_model_prefix!r}")
        found = models[0]
    base = model.get_submodule(found)
    if not any(isinstance(child, torch.nn.ModuleList) for child in base.children()):
        # OPT's and TrOCR's base models wrap one decoder, a model of its own that holds the layers and embeddings
        inner = [n for n, c in base.named_children() if isinstance(c, PreTrainedModel)]
        if len(inner) == 1:
            found = f"{found}.{inner[0]}"
    return found


def _call_style(lm_class: type[PreTrainedModel], layer: torch.nn.Module) -> CallStyle:
    params = list(inspect.signature(layer.forward).parameters.values())[1:]  # after the hidden states
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in _PASSED
    ]
    if required:
        raise BadInputError(
            f"{lm_class.__name__}: its layers need {', '.join(required)}, which its model computes around them"
        )
    names = {p.name for p in params}
    if "alibi" in names:
        raise BadInputError(f"{lm_class.__name__}: its layers take ALiBi biases its model builds (not inferred)")
    for keyword, style in _CALLS.items():
        if keyword in names:
            return style
    raise BadInputError(f"{lm_class.__name__}: its layers take no cache (a keyword among {', '.join(_CALLS)})")


def _rotary(base: torch.nn.Module) -> Rotary:
    named = rotary_attr(base)
    if named is None:
        return "none"
    rotary = getattr(base, named)
    params = inspect.signature(rotary.forward).parameters
    return "per_layer_type" if "layer_type" in params else "shared"


def _weighted(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stages(lm_class: type[PreTrainedModel], base: torch.nn.Module, layers: str) -> tuple[str, str | None, str | None]:
    """The final norm (``""``: none), learned positions and embedding norm among the base model's other modules."""
    embeddings = base.get_input_embeddings() if isinstance(base, PreTrainedModel) else None
    rest = [
        (name, child)
        for name, child in base.named_children()
        if name not in (layers, rotary_attr(base))
        and child is not embeddings
        and (_weighted(child) or "norm" in type(child).__name__.lower())  # OLMo's norm has no weights
    ]
    positions = [name for name, child in rest if isinstance(child, torch.nn.Embedding)]
    if len(positions) > 1:
        raise BadInputError(f"{lm_class.__name__}: several embedding tables beside the tokens': {positions}")
    norms = [name for name, child in rest if not isinstance(child, torch.nn.Embedding)]
    embed_norm = None
    if len(norms) == 2:  # one applied to the embeddings (its name says so), one at the end
        first = [n for n in norms if "emb" in n.lower()]
        if len(first) == 1:
            embed_norm = first[0]
            norms.remove(embed_norm)
    if len(norms) > 1:  # which runs where is not told by the modules: the model's own forward runs them
        # (``swarm.families.own_forward``: the modules' way, without them, then differs from it)
        return "", None, None
    return (norms[0] if norms else ""), (positions[0] if positions else None), embed_norm


@functools.cache
def _peft_targets() -> dict[str, list[str]]:
    """PEFT's default LoRA targets per model type, read from its source: importing ``peft`` loads bitsandbytes,
    torchao and torch's compiler (seconds on every start of a server of an inferred family, which needs only this
    table); the import is the fallback where the table is not a plain literal."""
    spec = importlib.util.find_spec("peft")  # a top-level package: found, not run
    if spec is not None and spec.origin is not None:
        try:
            tree = ast.parse((Path(spec.origin).parent / "utils" / "constants.py").read_text())
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
                    for t in node.targets
                ):
                    table = ast.literal_eval(node.value)
                    if isinstance(table, dict):
                        return {str(k): list(v) for k, v in table.items()}
        except (OSError, SyntaxError, ValueError):
            pass
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    return {k: list(v) for k, v in PEFT_TARGETS.items()}


def _lora_targets(layers: torch.nn.ModuleList, model_type: str) -> tuple[str, ...]:
    """PEFT's default targets for the model type where it has them, else the attention's query and value over all
    layers (a hybrid's first may be a state-space layer, whose projections PEFT refuses), else a likely fused one."""
    leaves = {path.rsplit(".", 1)[-1] for path, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}
    known = _peft_targets().get(model_type)
    if known and set(known) <= leaves:
        return tuple(known)
    for pair in (("q_proj", "v_proj"),):
        if set(pair) <= leaves:
            return pair
    return tuple(n for n in _LORA_NAMES if n in leaves)[:1] or tuple(sorted(leaves))[:2]


def _experts(layers: torch.nn.ModuleList) -> Experts:
    """``per_expert`` where the layer holds its experts fused (``gate_up_proj`` [E, 2I, H], as transformers 5 does)
    which ``save_pretrained`` writes one tensor per expert; else ``none``."""
    for path, module in layers.named_modules():  # every layer: the first ones may be dense (DeepSeek's)
        fused = getattr(module, "gate_up_proj", None)
        if path.rsplit(".", 1)[-1] == "experts" and isinstance(fused, torch.Tensor) and fused.ndim == 3:
            return "per_expert"
    return "none"


def infer_spec(lm_class: type[PreTrainedModel], config: PretrainedConfig, model: torch.nn.Module) -> FamilySpec:
    """The family of an unlisted class, from ``model`` (the class built on the meta device from ``config``) as far as
    its modules and signatures tell (``BadInputError`` with the reason where they cannot tell); the self-check then
    proves it or refuses it."""
    base_attr = _base_attr(lm_class, model)
    base = model.get_submodule(base_attr)
    attr, layers = _layers(lm_class, base)
    layer = layers[0]
    head = getattr(model, "get_output_embeddings")()  # noqa: B009 - typed as a module, it is the LM's method
    if not isinstance(head, torch.nn.Module):
        raise BadInputError(f"{lm_class.__name__}: it names no output embeddings (its LM head is not inferred)")
    # Modules with weights beside the base model and the head (ModernBERT-decoder's prediction head before its
    # decoder) are the client's too: its local model is the whole LM without layers, and ``family_of`` finds the
    # stage they change differing between the modules' way and the model's own, which it then takes.
    call = _call_style(lm_class, layer)
    norm, positions, embed_norm = _stages(lm_class, base, attr)
    scales = _scales(config)
    return FamilySpec(
        label=str(getattr(config, "model_type", lm_class.__name__)),
        call=call,
        rotary=_rotary(base),
        kv="gqa",
        experts=_experts(layers),
        norm=norm,
        positions=positions,
        embed_norm=embed_norm,
        lora_defaults=_lora_targets(layers, str(getattr(config, "model_type", ""))),
        inferred=True,
        embed=None,  # decided by ``family_of`` (``swarm.families.own_forward``)
        head=None,
        layers=attr,
        base=base_attr if base_attr != lm_class.base_model_prefix else None,
        materialize_mask=_forces_mask(base),
        mask_keywords=_mask_keywords(base, layer),
        window_masks=_source_has(base, "sliding_window"),
        embedding_multiplier=scales.get("embedding_multiplier"),
        logits_divisor=scales.get("logits_divisor"),
        logits_multiplier=scales.get("logits_multiplier"),
    )


def _mask_keywords(base: torch.nn.Module, layer: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """The masks the base model's forward passes its layers by a fixed layer kind (``conv_mask=
    causal_mask_mapping["linear_attention"]``), as its source says; a layer's own-kind mask is the default."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return ()
    # ``kw=mapping["kind"]``, or through a variable of the keyword's name (``conv_mask = mapping.get("kind")``)
    found = re.findall(r"(\w+)\s*=\s*\w*mask\w*(?:\[|\.get\()\s*[\"'](\w+)[\"']\s*[\])]", source)
    takes = inspect.signature(layer.forward).parameters
    return tuple(dict.fromkeys((k, v) for k, v in found if k.endswith("mask") and k in takes))


def _source_has(base: torch.nn.Module, word: str) -> bool:
    """Whether the base model's forward names ``word`` (where its source cannot be read: assume it does)."""
    try:
        return word in inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return True


def _forces_mask(base: torch.nn.Module) -> bool:
    """Whether the base model always builds its 4D causal mask (``allow_is_causal_skip`` off: DeepSeek-V3.2's indexer
    reads the mask even where attention could run as plain causal), as its forward's source says."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return re.search(r"allow_is_causal_skip\W{1,4}False", source) is not None


def _scales(config: PretrainedConfig) -> dict[str, str]:
    """Scalars the model applies around its layers, by the config attributes that name them (the self-check proves
    the class really applies them)."""
    found = {"embedding_multiplier": "embedding_multiplier", "logits_divisor": "logits_scaling"}
    found["logits_multiplier"] = "logit_scale"
    return {field: attr for field, attr in found.items() if isinstance(getattr(config, attr, None), int | float)}


def measure_kv(family: Family) -> tuple[tuple[str, int], ...]:
    """Cached elements per token (keys and values together) of each layer kind of ``family``, as its layers really
    cache them: a 2-token step of the first layer of each kind through a cache, on the meta device (no memory, no
    compute). Empty where that cannot run: the grouped-query formula (``swarm.families.kv``) then stands in."""
    from swarm.families import span

    firsts: dict[str, int] = {}
    for index in range(family.num_layers):
        firsts.setdefault(family.layer_kind(index), index)
    out: list[tuple[str, int]] = []
    try:
        with torch.device("meta"), torch.no_grad():
            rotary = family.new_rotary("meta")
            for kind, index in firsts.items():
                layer = family.build_layer(index).eval()
                cache = DynamicCache(config=family.config)
                hidden = torch.empty(1, 2, int(family.config.hidden_size), dtype=torch.float32)
                inputs = span.span_inputs(family, rotary, hidden, [index], cache=cache)
                span.call_layer(family, layer, index, hidden, inputs, cache)
                held = cache.layers[index]
                keys, values = getattr(held, "keys", None), getattr(held, "values", None)
                if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                    return ()
                out.append((kind, (keys.numel() + values.numel()) // 2))
    except Exception:  # noqa: BLE001 - a measurement that cannot run leaves the formula in place
        return ()
    return tuple(out)
