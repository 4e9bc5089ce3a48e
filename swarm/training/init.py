"""What a run starts from: the seeded scheme's whole model, or the weights it continues from (``swarm.training.seeds``
draws every tensor from its own seed), the trainer's own tensors, and the bound on a stage's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.training.seeds import (
    block_prefix,
    hf_names,
    init_full_model,
    init_module,
    init_tensor,
    layers_path,
    norm_params,
    seeded_client_state,
    tensor_seed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from swarm.ids import Span
    from swarm.training.run import RunConfig

__all__ = [  # the scheme itself lives in ``swarm.training.seeds`` (no run config: the proof uses it too)
    "block_prefix",
    "hf_names",
    "init_full_model",
    "init_module",
    "init_tensor",
    "layers_path",
    "norm_params",
    "seeded_client_state",
    "tensor_seed",
]


def initial_model(run: RunConfig) -> PreTrainedModel:
    """The whole model a run starts from: the weights it continues from, or the seeded initialisation."""
    from transformers import AutoModelForCausalLM

    from swarm.hub_snapshot import ensure
    from swarm.model_files import weight_map

    folder = run.source_folder()
    if folder is None:
        return init_full_model(run.hf_config(), run.seed)
    ensure(folder, set(weight_map(folder).values()))  # a Hub snapshot starts with no weights; all are read here
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model


def initial_client_state(run: RunConfig, names: list[str]) -> dict[str, torch.Tensor]:
    """The initial values of the trainer's own tensors ``names`` (embeddings, final norm, head), without building
    the blocks: read from the model the run continues from, or drawn from their seeds."""
    from swarm.families import local
    from swarm.families.spec import family_of
    from swarm.model_files import read_tensors, weight_map

    folder = run.source_folder()
    config = run.hf_config()
    if folder is None:
        return seeded_client_state(config, run.seed, names)
    mine = local.client_names(family_of(config), weight_map(folder))  # on-disk name -> the client's
    state = {mine[k]: v.float() for k, v in read_tensors(folder, list(mine)).items() if mine[k] in names}
    return state  # a tied head is the embeddings: the client ties them (``_load_local``)


def stage_state_bytes(run: RunConfig, stage: Span) -> int:
    """The most a stage's state (float32 weights and Adam's two moments, under DiLoCo the round's start and the outer
    momentum too, with their names and framing) can take on the wire: the bound a joining replica or an export puts
    on a peer's reply."""
    from swarm.model_files import new_model

    config = run.hf_config()
    head = f"{layers_path(config)}."  # ``model.layers.``: where the blocks' tensors are named
    with torch.device("meta"):
        params = new_model(config).named_parameters()
        numel = sum(p.numel() for name, p in params if _block_of(name, head) in stage)
    parts = 5 if run.sync.method == "diloco" else 3  # DiLoCo adds the round's start and the outer momentum
    return numel * 4 * parts + (numel * 4 * parts) // 10 + (1 << 20)


def _block_of(name: str, head: str) -> int:
    index = name[len(head) :].split(".", 1)[0] if name.startswith(head) else ""
    return int(index) if index.isdigit() else -1
