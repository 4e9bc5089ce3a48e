"""On-disk tensor names as transformers loads them: a class's conversion mapping renames what older checkpoints (and
its own ``save_pretrained``, which writes the original layout back) call its tensors (Nemotron-H's ``backbone``,
Bailing's ``word_embeddings`` and ``attention``). The swarm picks a layer's or the client's tensors by the names they
load as, and leaves the loading itself to transformers (``weights.load_layers``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch


def loaded_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each on-disk name -> the module name it loads as in ``model`` (a model built on meta is enough)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = cast(list[Any], get_model_conversion_mapping(cast(Any, model)))  # Any: transformers types neither
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    state = dict.fromkeys(model.state_dict(), True)
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = rename_source_key(name, renamings, converters, prefix, state)[0]
        except Exception:  # noqa: BLE001 - a name transformers' patterns cannot read: it stays as it is
            out[name] = name
    return out
