"""The few places where model families differ. Everything else is the generic transformers 5.24 decoder path:
``model.layers.{i}`` decoder layers called with rotary ``position_embeddings``, a causal (or sliding) mask and a
cache that layers update under their global index."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from swarm.errors import BadInputError

TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


@dataclass(frozen=True)
class Family:
    model_type: str
    layer_cls: type
    rotary_cls: type

    def layer_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def file_to_module(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors of one layer as stored on disk (prefix stripped) -> the names the 5.x module expects."""
        if self.model_type != "mixtral":
            return state
        # Mixtral files keep one w1/w2/w3 per expert; the 5.x module fuses them: gate_up = cat[w1, w3], down = w2.
        out: dict[str, torch.Tensor] = {}
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            m = re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", name)
            if m:
                experts.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
            else:
                out[name.replace("block_sparse_moe.", "mlp.")] = tensor
        if experts:
            order = sorted(experts)
            out["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([experts[e]["w1"], experts[e]["w3"]]) for e in order]
            )
            out["mlp.experts.down_proj"] = torch.stack([experts[e]["w2"] for e in order])
        return out

    def is_sliding(self, config: PretrainedConfig, index: int) -> bool:
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return bool(layer_types[index] == "sliding_attention")
        return getattr(config, "sliding_window", None) is not None


def family_for(config: PretrainedConfig) -> Family:
    model_type = config.model_type
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        raise BadInputError(f"model type {model_type!r} is not known to transformers") from None
    layer = [v for k, v in vars(module).items() if k.endswith("DecoderLayer") and isinstance(v, type)]
    rotary = [v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type)]
    if len(layer) != 1 or len(rotary) != 1:
        raise BadInputError(
            f"model type {model_type!r} is not a rotary decoder-only family; supported: {', '.join(TESTED_FAMILIES)}"
        )
    return Family(model_type=model_type, layer_cls=layer[0], rotary_cls=rotary[0])
