"""The embeddings and head stages run by the model's own forward, for inferred families whose base model does more
between its token embeddings and its first layer than the modules it holds tell (CTRL scales them inline, BioGPT and
OPT offset their learned positions and count them along the attention mask, nanochat normalises them with its final
norm).

The client's base model (no layers) is copied shallowly, so the copy shares its parameters, buffers and child modules,
and its layer list is replaced by one stand-in that raises as soon as the model calls it, carrying the hidden states
the model hands its first layer: whatever the class computes there, the split path then computes too. For cached
steps the forward gets the full attention mask and a cache that reports the tokens already cached (a few zeros on its
first attention layer), so positions continue as the class continues them.

The head stage the same way, from the other end: a copy of the causal LM whose layer list is one stand-in that
returns the last server's hidden states, called with zero embeddings: what the class does after its layers (a final
norm under any name, OPT's output projection, Recurrent-Gemma's soft-cap, logit scales) then runs as the class runs
it.

Whether a family needs them is decided in ``swarm.families.choose``: the two ways run on a tiny twin of the config
with perturbed weights, and the model's own way is taken where they disagree (the self-check proves whichever is
taken)."""

from __future__ import annotations

import copy
import inspect
import threading
import weakref

import torch
from transformers import DynamicCache, PreTrainedModel

from swarm.errors import BadInputError
from swarm.families import shell, span
from swarm.families.family import Family, rotary_attr
from swarm.families.twin import twin_of


class _Reached(Exception):
    """What the model handed its first layer."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("the model reached its first layer")
        self.hidden = hidden


class _FirstLayer(torch.nn.Module):
    """Stands in for the first decoder layer (with the attributes models read off a layer before calling it)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.attention_type = kind
        self.layer_type = kind

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise _Reached(hidden_states)


def _replaced(module: torch.nn.Module, path: str, new: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` (its parameters, buffers and other children shared) with ``new`` at ``path``."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    first, _, rest = path.partition(".")
    inner = module._modules[first]
    assert inner is not None
    out._modules[first] = _replaced(inner, rest, new) if rest else new
    return out


def _staged_base(family: Family, base: PreTrainedModel, stand_in: torch.nn.Module) -> torch.nn.Module:
    """``base`` with ``stand_in`` as its only layer, reading the family's full config (the local model's has no
    layers, and its rotary module, built for no layer types, lacks the tables of each: weightless, built again)."""
    staged = _replaced(base, family.layers_attr, torch.nn.ModuleList([stand_in]))
    staged.__dict__["config"] = family.config
    named = rotary_attr(base)
    if named is not None and family.rotary_class is not None:
        weight = base.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)
        staged._modules[named] = family.rotary_class(config=family.config).to(weight.device)
    return staged


# base model -> its copy ending at the stand-in, and the keywords its forward takes (read once, not per token;
# weak: the copy goes with the client's model)
_STAGES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def _stage(family: Family, base: PreTrainedModel) -> tuple[torch.nn.Module, frozenset[str]]:
    held = _STAGES.get(base)
    if held is None:
        keywords = frozenset(inspect.signature(type(base).forward).parameters)
        held = _STAGES[base] = (_staged_base(family, base, _FirstLayer(family.layer_kind(0))), keywords)
    return held


def _past_cache(family: Family, batch: int, past: int, like: torch.Tensor) -> DynamicCache:
    """A cache that reports ``past`` tokens cached (on the first attention layer; what the model counts from)."""
    cache = DynamicCache(config=family.config)
    first = next((i for i in range(family.num_layers) if family.layer_kind(i) in span.ATTENTION_KINDS), 0)
    zeros = torch.zeros(batch, 1, past, 1, device=like.device, dtype=torch.float32)
    cache.update(zeros, zeros, first)
    return cache


def forward_embed(
    family: Family,
    base: PreTrainedModel,
    *,
    ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    past: int = 0,
) -> torch.Tensor:
    """What the class hands its first layer for ``ids`` (or ``inputs_embeds``) with ``past`` tokens cached before
    them; ``mask`` [batch, past + n] of 0/1 (None: no padding)."""
    stage, params = _stage(family, base)
    given = ids if ids is not None else inputs_embeds
    assert given is not None
    kwargs: dict[str, object] = {"input_ids": ids} if ids is not None else {"inputs_embeds": inputs_embeds}
    if mask is not None:
        kwargs["attention_mask"] = mask.to(given.device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids.to(given.device)
    if "use_cache" in params:
        kwargs["use_cache"] = past > 0
    if past:
        keyword = "cache" if "cache" in params else "past_key_values"
        kwargs[keyword] = _past_cache(family, given.shape[0], past, given)
    try:
        stage(**kwargs)
    except _Reached as reached:
        return reached.hidden
    raise BadInputError(f"{family.label}: its model never called its first layer")


class _Injected(torch.nn.Module):
    """Stands in for the layers: returns the hidden states given for this call (per thread: calls may overlap)."""

    def __init__(self, kind: str, as_tuple: bool) -> None:
        super().__init__()
        self.attention_type = kind
        self.layer_type = kind
        self.as_tuple = as_tuple
        self.given = threading.local()

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        out: torch.Tensor = self.given.hidden
        return (out,) if self.as_tuple else out


# base model -> (the LM head it was built with, the LM copy around the stand-in, the stand-in)
_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, torch.nn.Module, _Injected]] = (
    weakref.WeakKeyDictionary()
)


def _head_stage(family: Family, base: PreTrainedModel, lm_head: torch.nn.Module) -> tuple[torch.nn.Module, _Injected]:
    held = _HEADS.get(base)
    if held is not None and held[0] is lm_head:
        return held[1], held[2]
    outer = shell.local_model(family, device="meta")  # the class's LM around base and head: nothing allocated
    injected = _Injected(family.layer_kind(family.num_layers - 1), returns_tuple(family))
    lm = _replaced(outer, family.base_prefix, _staged_base(family, base, injected))
    lm = _replaced(lm, shell.head_name(outer), lm_head)
    for name, module in shell.beside_of(base).items():  # the local model's own, loaded with its weights
        lm = _replaced(lm, name, module)
    lm.__dict__["config"] = family.config
    _HEADS[base] = (lm_head, lm, injected)
    return lm, injected


def forward_head(family: Family, base: PreTrainedModel, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits for the last layer's ``hidden`` states, as the class computes them after its layers."""
    lm, injected = _head_stage(family, base, lm_head)
    embeddings = base.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    zeros = torch.zeros(*hidden.shape[:2], embeddings.embedding_dim, device=hidden.device, dtype=hidden.dtype)
    injected.given.hidden = hidden
    try:
        out = lm(inputs_embeds=zeros, use_cache=False)
    finally:
        injected.given.hidden = None
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    return logits


def returns_tuple(family: Family) -> bool:
    """Whether the family's layers return a tuple (hidden states first) rather than the hidden states: what the
    model's loop unpacks. Read off the first layer of a tiny twin, run once on CPU (some layers cannot run on meta)."""
    seen: list[bool] = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            twin = twin_of(family)
            layer = twin.build_layer(0).eval()
            layer.register_forward_hook(lambda _m, _a, out: seen.append(isinstance(out, tuple)))
            hidden = torch.randn(1, 2, int(twin.config.hidden_size))
            inputs = span.span_inputs(twin, twin.new_rotary("cpu"), hidden, [0])
            span.call_layer(twin, layer, 0, hidden, inputs, None)
    except Exception:  # noqa: BLE001 - a layer that cannot run so: the usual (tensor) convention
        return False
    return bool(seen and seen[0])
