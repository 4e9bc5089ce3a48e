"""Initial weights from per-tensor seeds: the tensor named ``model.layers.3.mlp.up_proj.weight`` of a run with seed
``s`` is drawn from a generator seeded by (s, that name) alone, so a peer that initialises only its span gets exactly
what a full local model initialised by the same scheme gets, whatever the order or the split.

The distributions follow Hugging Face's decoder initialisation: matrices (linear, embedding, fused experts) from
N(0, initializer_range), norm weights one, biases zero."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from swarm.ids import Span
    from swarm.training.run import RunConfig


def tensor_seed(run_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: tuple[int, ...], std: float, run_seed: int) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape) if "norm" in name.rsplit(".", 1)[0] else torch.zeros(shape)
    gen = torch.Generator().manual_seed(tensor_seed(run_seed, name))
    return torch.randn(shape, generator=gen) * std


def init_module(module: torch.nn.Module, prefix: str, config: PretrainedConfig, run_seed: int) -> None:
    """Fill every parameter of ``module`` (named ``prefix`` + its name in the module) by the scheme above."""
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(init_tensor(prefix + name, tuple(param.shape), std, run_seed).to(param.dtype))


def init_full_model(config: PretrainedConfig, run_seed: int) -> PreTrainedModel:
    """A whole local Hugging Face model initialised by the scheme (the reference the swarm must equal)."""
    from swarm.model_files import new_model

    model = new_model(config, torch.float32)
    init_module(model, "", config, run_seed)
    return model


def initial_model(run: RunConfig) -> PreTrainedModel:
    """The whole model a run starts from: the weights it continues from, or the seeded initialisation."""
    from transformers import AutoModelForCausalLM

    folder = run.source_folder()
    if folder is None:
        return init_full_model(run.hf_config(), run.seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model


def initial_client_state(run: RunConfig, names: list[str]) -> dict[str, torch.Tensor]:
    """The initial values of the trainer's own tensors ``names`` (embeddings, final norm, head), without building
    the blocks: read from the model the run continues from, or drawn from their seeds."""
    from swarm.model_files import new_model, read_tensors, weight_map

    folder = run.source_folder()
    if folder is None:
        config = run.hf_config()
        std = float(getattr(config, "initializer_range", 0.02))
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in new_model(config).state_dict().items()}
        return {name: init_tensor(name, shapes[name], std, run.seed) for name in names}
    available = weight_map(folder)
    state = read_tensors(folder, [n for n in names if n in available])
    if "lm_head.weight" in names and "lm_head.weight" not in state:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return {k: v.float() for k, v in state.items()}


def stage_state_bytes(run: RunConfig, stage: Span) -> int:
    """The most a stage's state (float32 weights and Adam's two moments, with their names and framing) can take on
    the wire: the bound a joining replica or an export puts on a peer's reply."""
    from swarm.model_files import new_model

    with torch.device("meta"):
        params = new_model(run.hf_config()).named_parameters()
        numel = sum(p.numel() for name, p in params if _block_of(name) in stage)
    return numel * 4 * 3 + (numel * 4 * 3) // 10 + (1 << 20)


def _block_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1
