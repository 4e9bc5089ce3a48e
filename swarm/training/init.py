"""Initial weights from per-tensor seeds: the tensor named ``model.layers.3.mlp.up_proj.weight`` of a run with seed
``s`` is drawn from a generator seeded by (s, that name) alone, so a peer that initialises only its span gets exactly
what a full local model initialised by the same scheme gets, whatever the order or the split.

The distributions follow Hugging Face's decoder initialisation: matrices (linear, embedding, fused experts) from
N(0, initializer_range), norm weights one, biases zero."""

from __future__ import annotations

import hashlib

import torch


def tensor_seed(run_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: tuple[int, ...], std: float, run_seed: int) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape) if "norm" in name.rsplit(".", 1)[0] else torch.zeros(shape)
    gen = torch.Generator().manual_seed(tensor_seed(run_seed, name))
    return torch.randn(shape, generator=gen) * std


def init_module(module: torch.nn.Module, prefix: str, config, run_seed: int) -> None:
    """Fill every parameter of ``module`` (named ``prefix`` + its name in the module) by the scheme above."""
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(init_tensor(prefix + name, tuple(param.shape), std, run_seed).to(param.dtype))


def init_full_model(config, run_seed: int) -> torch.nn.Module:
    """A whole local Hugging Face model initialised by the scheme (the reference the swarm must equal)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_module(model, "", config, run_seed)
    return model
