"""A span run here from the model folder, one block at a time: how a reader that holds the weights judges an
accusation itself (``swarm.rpc.judging``) instead of believing servers anyone can announce.

Only one block's tensors are held at a time, in float32 on the CPU (a 70B block: about 3.4 GB, twice its 16-bit
size): the most exact reference there is for an output committed in any dtype. Accusations and verification
disputes are rare and each reader judges at most a few per look, so the cost is bounded by the judging's own
pacing; a client also decides its own verification disputes this way (``swarm.client.verify.verifier``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from swarm.families import span as family_span
from swarm.families import weights
from swarm.families.family import Family
from swarm.verdict import Local

log = logging.getLogger(__name__)


def recompute(
    family: Family, folder: Path, inputs: torch.Tensor, start: int, end: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocks ``start:end`` over ``inputs`` [batch, n, hidden] (at ``positions`` [batch, n]; None: 0 .. n-1; no
    padding): what an honest server of that span returns for the same prefill, in float32."""
    if not 0 <= start < end <= family.num_layers:
        raise ValueError(f"blocks {start}:{end} of a {family.num_layers}-block model")
    hidden = inputs.detach().float().cpu()
    batch, n = hidden.shape[0], hidden.shape[1]
    if positions is None:
        positions = torch.arange(n).expand(batch, -1)
    rotary = family.new_rotary("cpu")
    with torch.no_grad():
        for index in range(start, end):
            (layer,) = weights.load_layers(family, folder, [index], torch.float32, "cpu")
            layer.eval()
            hidden = family_span.run_span(family, [layer], [index], hidden, rotary, position_ids=positions)
            del layer
    return hidden


def local_judge(family: Family, folder: Path | None, cache_dir: Path) -> Local | None:
    """A reader's own judge of accusations against servers of the weights in ``folder`` (unquantized, in any
    serving dtype); None without a folder. It answers None for other weights, and where the folder lacks a block's
    tensors (a reader that downloaded only its own part)."""
    if folder is None:
        return None
    from swarm.model_files import served_fingerprints

    mine = served_fingerprints(folder, cache_dir)

    def run(
        inputs: torch.Tensor, start: int, end: int, fingerprint: str, positions: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if fingerprint not in mine:
            return None
        try:
            return recompute(family, folder, inputs, start, end, positions)
        except Exception as e:  # noqa: BLE001 - then the reader's trusted judges decide, or nobody
            log.info("cannot run blocks %d:%d here to judge an accusation: %s", start, end, e)
            return None

    return run
