"""Shared fixtures: tiny random models of each family (saved once per session), the converted SmolLM2 folder, and
helpers to compare a swarm against a local Hugging Face run of the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FAMILY_CONFIGS = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=16),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
}


def make_tiny_model(folder: Path, model_type: str, seed: int = 0, perturb: float = 0.0, **overrides) -> Path:
    """``perturb``: add N(0, perturb) to every weight (norms initialised to 0 or 1 and zero-initialised MoE routers
    would otherwise hide mistakes, or tie the routers' choices)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    model.save_pretrained(folder, max_shard_size="100KB")  # several shards, so selective reads are exercised
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for family, cfg in FAMILY_CONFIGS.items():
        cfg = dict(cfg)
        out[family] = make_tiny_model(root / f"tiny-{family}", cfg.pop("model_type"), **cfg)
    return out


@pytest.fixture(scope="session")
def smollm_folder() -> Path:
    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import model_folder

    return model_folder(load_model_card("smollm2-135m"), default_cache_dir())


def local_reference(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()
