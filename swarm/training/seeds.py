"""Initial weights from per-tensor seeds: the tensor Hugging Face's model of the family names
``model.layers.3.mlp.up_proj.weight`` (``transformer.h.3.mlp.c_fc.weight`` for GPT-2: always the name in the full
causal LM, whatever the family calls its parts) of a run with seed ``s`` is drawn from a generator seeded by
(s, that name) alone, so a peer that initialises only its span, and a trainer only its embeddings and head, get
exactly what a full local model initialised by the same scheme gets, whatever the order or the split.

The distributions follow Hugging Face's decoder initialisation: matrices (linear, embedding, fused experts) from
N(0, initializer_range), the weights of normalisation layers one, every other vector (biases) zero."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def tensor_seed(run_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: tuple[int, ...], std: float, run_seed: int, norm: bool | None = None) -> torch.Tensor:
    """The initial value of tensor ``name``; ``norm``: it is a normalisation layer's (None: judged by its name)."""
    if len(shape) == 1:
        if norm is None:
            norm = "norm" in name.rsplit(".", 1)[0]
        return torch.ones(shape) if norm and name.endswith("weight") else torch.zeros(shape)
    gen = torch.Generator().manual_seed(tensor_seed(run_seed, name))
    return torch.randn(shape, generator=gen) * std


def norm_params(module: torch.nn.Module) -> set[str]:
    """Names of the parameters of ``module`` that belong to normalisation layers (by class or by name: GPT-2's
    ``ln_1`` is a ``LayerNorm``, Llama's ``input_layernorm`` an ``RMSNorm``)."""
    return {
        f"{path}.{name}" if path else name
        for path, sub in module.named_modules()
        if "norm" in type(sub).__name__.lower() or "norm" in path.rsplit(".", 1)[-1].lower()
        for name, _ in sub.named_parameters(recurse=False)
    }


def init_module(module: torch.nn.Module, prefix: str, config: PretrainedConfig, run_seed: int) -> None:
    """Fill every parameter of ``module`` (named ``prefix`` + its name in the module) by the scheme above."""
    std = float(getattr(config, "initializer_range", 0.02))
    norms = norm_params(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = init_tensor(prefix + name, tuple(param.shape), std, run_seed, name in norms)
            param.copy_(value.to(param.dtype))


def layers_path(config: PretrainedConfig) -> str:
    """Where the family's causal LM keeps its blocks (``model.layers``, ``transformer.h``): the names a block's seeds,
    a stage's state and an exported checkpoint use."""
    from swarm.families.spec import family_of

    return family_of(config).layers_path


def block_prefix(config: PretrainedConfig, index: int) -> str:
    """Block ``index``'s tensors' prefix in the family's causal LM (``model.layers.3.``, ``transformer.h.3.``)."""
    return f"{layers_path(config)}.{index}."


def hf_names(config: PretrainedConfig) -> dict[str, str]:
    """The trainer's own tensors (the client's names: ``model.embed_tokens.weight``, ``lm_head.weight``) -> their
    names in the family's causal LM (GPT-2's ``transformer.wte.weight``)."""
    from swarm.families import local
    from swarm.families.spec import family_of
    from swarm.model_files import new_model

    with torch.device("meta"):
        names = list(new_model(config).state_dict())
    return {client: hf for hf, client in local.client_names(family_of(config), names).items()}


def init_full_model(config: PretrainedConfig, run_seed: int) -> PreTrainedModel:
    """A whole local Hugging Face model initialised by the scheme (the reference the swarm must equal)."""
    from swarm.model_files import new_model

    model = new_model(config, torch.float32)
    init_module(model, "", config, run_seed)
    return model


def seeded_client_state(config: PretrainedConfig, run_seed: int, names: list[str]) -> dict[str, torch.Tensor]:
    """The trainer's own tensors ``names`` (the client's names) drawn by the scheme, each under its name in the
    family's causal LM (``hf_names``), as one process draws them."""
    from swarm.model_files import new_model

    std = float(getattr(config, "initializer_range", 0.02))
    with torch.device("meta"):
        model = new_model(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    norms, theirs = norm_params(model), hf_names(config)
    return {n: init_tensor(theirs[n], shapes[theirs[n]], std, run_seed, theirs[n] in norms) for n in names}
