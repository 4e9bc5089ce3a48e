"""The family layer as a server sees it (``swarm.families``, shared with the client): ``family_for`` finds the family
of a config from its architecture and proves, on a shrunk twin of the config, that the split path reproduces Hugging
Face's own forward exactly; a model it cannot serve exactly is refused with the reason (the peer exits non-zero)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from swarm.families.selfcheck import require_exact
from swarm.families.spec import Family, supported_labels

__all__ = ["Family", "family_for", "supported_labels"]


def family_for(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> Family:
    """The family of ``config`` (its ``config`` carries the attention implementation the family runs), or
    BadInputError naming what cannot be served exactly in ``dtype``."""
    return require_exact(config, dtype)
