"""Selective loading of a span of blocks: open only the shards that hold them and read only their tensors."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import PretrainedConfig

from peers.blocks.families import Family
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.model_files import read_tensors, weight_map

log = logging.getLogger(__name__)


def load_span(
    folder: Path, config: PretrainedConfig, family: Family, span: Span, dtype: torch.dtype, device: str
) -> torch.nn.ModuleList:
    """Build the span's layers on the meta device and assign the tensors read from disk (no double allocation)."""
    if span.end > config.num_hidden_layers:
        raise BadInputError(f"blocks {span} exceed the model's {config.num_hidden_layers} blocks")
    mapping = weight_map(folder)
    layers = []
    for index in range(span.start, span.end):
        prefix = family.layer_prefix(index)
        names = [k for k in mapping if k.startswith(prefix)]
        state = {k[len(prefix) :]: v for k, v in read_tensors(folder, names).items()}
        state = {k: v.to(dtype=dtype, device=device) for k, v in family.file_to_module(state).items()}
        with torch.device("meta"):
            layer = family.layer_cls(config, layer_idx=index)
        layer.load_state_dict(state, strict=True, assign=True)
        leftovers = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if leftovers:
            raise BadInputError(f"block {index}: no weights for {leftovers}")
        layer.requires_grad_(False)
        layers.append(layer.eval())
    return torch.nn.ModuleList(layers)


def block_bytes(folder: Path, family: Family, dtype: torch.dtype) -> int:
    """Bytes one block takes in ``dtype``, from the safetensors headers alone (block 0; all blocks are alike)."""
    from safetensors import safe_open

    mapping = weight_map(folder)
    prefix = family.layer_prefix(0)
    total = 0
    for file in {mapping[k] for k in mapping if k.startswith(prefix)}:
        with safe_open(str(folder / file), "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    numel = 1
                    for dim in f.get_slice(key).get_shape():
                        numel *= dim
                    total += numel * dtype.itemsize
    return total
