"""Which way an inferred family's embeddings and head stages run (``swarm.families.own_forward``): from the modules the
base model holds, or through the model's own forward. Both run on a tiny twin of the config with perturbed weights,
and the model's own way is taken where they disagree; the self-check then proves whichever was taken. A pure
function of the family (``family_of`` asks it once per config)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from swarm.families import local, own_forward
from swarm.families.family import Family
from swarm.families.twin import VOCAB, twin_of


def decide(family: Family) -> Family:
    """``family`` with its undecided stages (``spec.embed``/``spec.head`` None) decided."""
    spec = family.spec
    plain = dataclasses.replace(family, spec=dataclasses.replace(spec, embed="modules", head="modules"))
    embed = spec.embed or ("forward" if embed_differs(plain) else "modules")
    head = spec.head or ("forward" if head_differs(plain) else "modules")
    return dataclasses.replace(family, spec=dataclasses.replace(spec, embed=embed, head=head))


def _perturbed_twin(family: Family, seed: int) -> tuple[Family, PreTrainedModel, torch.Generator]:
    """The twin's local model with weights drawn from ``seed`` (norm weights around one, none left at 0 or 1)."""
    twin = twin_of(family)
    lm = local.local_model(twin)
    gen = torch.Generator().manual_seed(seed)
    for p in lm.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.ndim == 1 else 0.0))
    return twin, lm, gen


def embed_differs(family: Family) -> bool:
    """Whether the class's own embeddings stage differs from the one its modules tell (``local.embed``), on a tiny
    twin with perturbed weights: a left-padded prompt and a cached step. Where the model's own way cannot run, the
    modules' way stays; where only the modules' way fails, the model's own is taken (the self-check proves either)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            twin, lm, gen = _perturbed_twin(family, 11)
            base = local.base_of(twin, lm)
            ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
            mask = torch.ones(2, 6, dtype=torch.long)
            mask[1, :2] = 0
            steps = [(ids[:, past : past + n], mask[:, : past + n], past) for n, past in ((4, 0), (2, 4))]
            own = [own_forward.forward_embed(twin, base, ids=part, mask=m, past=past) for part, m, past in steps]
        except Exception:  # noqa: BLE001 - the model's own way cannot run here: the modules' way stays
            return False
        try:
            told = [local.embed(twin, base, part, past=past) for part, _, past in steps]
        except Exception:  # noqa: BLE001 - the modules' way cannot run: the model's own
            return True
    for (_, m, past), a, b in zip(steps, own, told, strict=True):
        keep = m[:, past:].bool()
        if a.shape != b.shape or float((a - b)[keep].abs().max()) > 1e-6:
            return True
    return False


def head_differs(family: Family) -> bool:
    """Whether the class's own head stage differs from the one its modules tell (``local.head``), on a tiny twin with
    perturbed weights (as ``embed_differs``)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            twin, lm, gen = _perturbed_twin(family, 12)
            base, head = local.base_of(twin, lm), local.head_of(lm)
            hidden = torch.randn(2, 3, int(twin.config.hidden_size), generator=gen)
            own = own_forward.forward_head(twin, base, head, hidden)
        except Exception:  # noqa: BLE001 - the model's own way cannot run here: the modules' way stays
            return False
        try:
            told = local.head(twin, base, head, hidden)
        except Exception:  # noqa: BLE001 - the modules' way cannot run: the model's own
            return True
    return own.shape != told.shape or float((own - told).abs().max()) > 1e-5 * max(1.0, float(own.abs().max()))
