"""The client's local parts, per family: what runs before the first layer (token embeddings with their scaling,
learned positions, an embedding norm) and after the last (the final norm under its family's name, the LM head, a
final-logit soft-cap).

They are the family's own causal-LM class with zero layers (``swarm.families.shell``); an inferred family whose model
does more around its layers than its modules tell runs those stages through the model's own forward
(``swarm.families.own_forward``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from transformers import PreTrainedModel

from swarm.errors import BadInputError
from swarm.families import own_forward
from swarm.families.family import Family
from swarm.families.shell import base_of, beside_of, head_name, head_of, local_model, restore_buffers

__all__ = ["base_of", "beside_of", "head_name", "head_of", "local_model", "restore_buffers"]  # built in ``shell``


def embed(
    family: Family,
    base: PreTrainedModel,
    ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    past: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """What enters the first layer, from the base model's modules: token embeddings (scaled inside Gemma's module),
    plus learned positions (GPT-2; ``position_ids`` default to ``past`` onwards, as Hugging Face's), then BLOOM's
    embedding norm. Or, for a family whose model does more there, through its own forward (``stage``; ``mask``:
    [batch, past + n], None without padding)."""
    if family.spec.embed == "forward":
        return own_forward.forward_embed(family, base, ids=ids, position_ids=position_ids, mask=mask, past=past)
    embedding = base.get_input_embeddings()
    assert isinstance(embedding, torch.nn.Module)
    return finish_embedding(family, base, embedding(ids), position_ids, past)


def finish_embedding(
    family: Family,
    base: PreTrainedModel,
    hidden: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    past: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the model adds to token embeddings (or to a caller's ``inputs_embeds``, as Hugging Face's model does):
    learned positions, then an embedding norm. The identity for most families."""
    spec = family.spec
    if spec.embed == "forward":
        return own_forward.forward_embed(
            family, base, inputs_embeds=hidden, position_ids=position_ids, mask=mask, past=past
        )
    if spec.positions is not None:
        if position_ids is None:
            position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        hidden = hidden + getattr(base, spec.positions)(position_ids.to(hidden.device))
    if spec.embed_norm is not None:
        hidden = getattr(base, spec.embed_norm)(hidden)
    if spec.embedding_multiplier is not None:
        hidden = hidden * float(getattr(family.config, spec.embedding_multiplier))
    return hidden


def head(family: Family, base: torch.nn.Module, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the last layer's hidden states: final norm, LM head, the family's logit scale (Cohere's, Granite's),
    then the final soft-cap if configured; or, for a family whose model does more there, through its own forward."""
    if family.spec.head == "forward":
        assert isinstance(base, PreTrainedModel)
        return own_forward.forward_head(family, base, lm_head, hidden)
    if family.spec.norm:  # a family without a final norm (inferred: none among its base model's modules)
        hidden = getattr(base, family.spec.norm)(hidden)
    logits = _rows(lm_head, hidden)
    spec = family.spec
    if spec.logits_multiplier is not None:
        logits = logits * float(getattr(family.config, spec.logits_multiplier))
    if spec.logits_divisor is not None:
        logits = logits / float(getattr(family.config, spec.logits_divisor))
    cap = getattr(family.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _rows(lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head(hidden)``, with 2 or 3 rows on a CPU padded to 4: torch's CPU matrix product runs so few rows as
    that many matrix-vector products, each reading the head's weights again (SmolLM2's head, one thread: 1 row 9.9
    ms, 2 rows 23.7, 3 rows 35.8, 4 rows 17.2), and a speculative step's few positions are exactly such rows."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.device.type != "cpu" or not 1 < flat.shape[0] < 4:
        out: torch.Tensor = lm_head(hidden)
        return out
    padded = torch.cat([flat, flat.new_zeros(4 - flat.shape[0], flat.shape[1])])
    rows: torch.Tensor = lm_head(padded)[: flat.shape[0]]
    return rows.reshape(*hidden.shape[:-1], rows.shape[-1])


def local_names(model: torch.nn.Module) -> list[str]:
    """The local parts' tensors, by module name (persistent state only)."""
    return list(model.state_dict())


def disk_to_local(family: Family, disk_names: Iterable[str], model: torch.nn.Module) -> dict[str, str]:
    """Which on-disk tensor fills which local tensor: the family's renames (NeoX's ``embed_out``), and checkpoints
    saved without the base prefix (the original GPT-2 and BLOOM files: ``wte.weight``, ``ln_f.weight``)."""
    wanted = set(local_names(model))
    names = list(disk_names)
    loaded = {n: n for n in names}
    if family.spec.inferred:  # as transformers loads them (``renames``: Bailing's ``word_embeddings``)
        from swarm.families.renames import loaded_names

        loaded = loaded_names(model, names)
    out: dict[str, str] = {}
    for disk in names:
        name = loaded[disk]
        if re.match(rf"^(?:{re.escape(family.base_prefix)}\.)?{family.layers_attr}\.\d+\.", name):
            continue  # a layer's tensor: never read by the client
        for old, new in family.spec.disk_renames:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name not in wanted and f"{family.base_prefix}.{name}" in wanted:
            name = f"{family.base_prefix}.{name}"
        if name in wanted:
            out[disk] = name
    return out


def client_names(family: Family, disk_names: Iterable[str]) -> dict[str, str]:
    """On-disk (or Hugging Face module) name -> the swarm client's name, for the local tensors: ``disk_to_local``,
    then the client's own layout (the base model is ``model.`` and the head ``lm_head.`` whatever the family calls
    them, the LM's other modules ``beside.``)."""
    lm = local_model(family, device="meta")
    beside = ((f"{n}.", f"beside.{n}.") for n in beside_of(base_of(family, lm)))
    renames = ((family.base_prefix + ".", "model."), (head_name(lm) + ".", "lm_head."), *beside)
    out = {}
    for k, v in disk_to_local(family, disk_names, lm).items():
        old, new = next(((o, n) for o, n in renames if v.startswith(o)), ("", ""))
        out[k] = new + v[len(old) :]
    return out


def load_local(family: Family, model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> None:
    """Fill the local parts from ``state`` (module names); the head takes the embeddings when the config ties them."""
    tied = bool(getattr(family.config, "tie_word_embeddings", False))
    head_module = head_of(model)
    head_names = {f"{n}.weight" for n, m in model.named_modules() if m is head_module}
    missing = [n for n in local_names(model) if n not in state and not (tied and n in head_names)]
    if missing:
        raise BadInputError(f"{family.label}: the checkpoint lacks the client's tensors {missing}")
    model.load_state_dict({k: v for k, v in state.items() if k in set(local_names(model))}, strict=False, assign=True)
    if tied:
        head_module.weight = model.get_input_embeddings().weight
    restore_buffers(family, base_of(family, model))  # on the loaded weights' device and dtype
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise BadInputError(f"{family.label}: local tensors left without values: {left}")
