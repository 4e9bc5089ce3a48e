"""A stage's state as tensors by part and tensor name (what a replica sends a joiner, what a checkpoint holds),
checked whole before a replica takes any of it: finite, every tensor of the right shape and dtype, and Adam moments
that an AdamW could hold (``swarm.training.optim.moments_hold``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.errors import BadInputError
from swarm.training.optim import moments_hold

STATE_PARTS = ("param.", "exp_avg.", "exp_avg_sq.")  # a state's tensors: weights, then Adam's two moments
Parts = dict[str, list[torch.Tensor] | None]  # part -> its tensors in the stage's order (None: absent, optional)


def parse_state(
    tensors: dict[str, torch.Tensor],
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    parts: Sequence[str],
    optional: set[str],
    betas: tuple[float, float],
) -> Parts:
    """``tensors`` as ``parts``, each with one tensor per name fitting the parameter of that name; a part in
    ``optional`` may be wholly absent. ``BadInputError`` naming the first thing wrong."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise BadInputError("the state holds NaN or infinite values")
    found: Parts = {}
    for part in parts:
        sources = [tensors.get(part + name) for name in names]
        if part in optional and all(t is None for t in sources):
            found[part] = None
            continue
        for i, (source, p) in enumerate(zip(sources, params, strict=True)):
            if source is None or source.shape != p.shape or source.dtype != p.dtype:
                raise BadInputError(f"state lacks a fitting {part}{names[i]} (tensor {i})")
        found[part] = [t for t in sources if t is not None]
    m, v = found.get(STATE_PARTS[1]), found.get(STATE_PARTS[2])
    if m is not None and v is not None and not moments_hold(m, v, betas):
        raise BadInputError("the state's Adam moments are none an AdamW can hold (a first moment too large)")
    return found
