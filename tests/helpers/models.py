"""Tiny random models of each family saved to a folder (``make_tiny_model``; ``TinyModels`` saves each family's the
first time a test asks for it, the ``tiny_models`` fixture), and the local Hugging Face run of the same weights that
the swarm's outputs are compared with (``local_reference``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

# Every family's weights are perturbed (``perturb``): norms initialised to exactly 1 (Gemma's to 0), biases to 0 and
# zero MoE routers would let a swapped or missing norm or bias pass, or tie the routers' choices. ``tiny_models``
# checks that no saved tensor is constant.
FAMILY_CONFIGS = {
    "llama": dict(model_type="llama", perturb=0.02),
    "mistral": dict(model_type="mistral", sliding_window=16, perturb=0.02),
    "qwen2": dict(model_type="qwen2", perturb=0.02),  # q/k/v biases
    "qwen3": dict(model_type="qwen3", head_dim=16, perturb=0.02),  # q/k norms
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, perturb=0.02),
    "gemma2": dict(
        model_type="gemma2",
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        tie_word_embeddings=True,
        perturb=0.02,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=20.0,
        perturb=0.02,
    ),
    "gpt2": dict(
        model_type="gpt2", n_inner=128, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True, perturb=0.02
    ),
    "gpt_neox": dict(model_type="gpt_neox", rotary_pct=0.25, use_parallel_residual=True, perturb=0.02),
    "falcon": dict(
        model_type="falcon",
        num_kv_heads=2,
        new_decoder_architecture=True,
        parallel_attn=True,
        alibi=False,
        perturb=0.02,
    ),
    "falcon_alibi": dict(
        model_type="falcon",
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        alibi=True,
        perturb=0.02,
    ),
    "bloom": dict(model_type="bloom", perturb=0.02),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        mlp_only_layers=[0],
        perturb=0.02,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        perturb=0.02,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        intermediate_size=64,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        perturb=0.02,
    ),
    # not rows of the family table: inferred from the class and proven by the self-check (swarm.families.infer)
    "phi3": dict(model_type="phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2, perturb=0.02),  # fused qkv
    "olmo2": dict(model_type="olmo2", pad_token_id=0, bos_token_id=1, eos_token_id=2, perturb=0.02),  # q/k norms
    # OPT: its layers under ``model.decoder``, positions counted along the attention mask from an offset, and
    # projections in and out of a narrower embedding: embeddings and head run through its own forward
    "opt": dict(model_type="opt", ffn_dim=128, word_embed_proj_dim=32, perturb=0.02),
    # inferred: a prediction head beside the LM head (held by the client), token ids inside the tiny vocabulary
    "modernbert-decoder": dict(
        model_type="modernbert-decoder",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sep_token_id=2,
        cls_token_id=1,
        perturb=0.02,
    ),
    # inferred: Mamba-2, attention, MoE and MLP layers, saved under the legacy ``backbone.`` names
    "nemotron_h": dict(
        model_type="nemotron_h",
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=4,
        head_dim=16,
        ssm_state_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        perturb=0.02,
    ),
    # inferred: attention and Mamba side by side in each layer, each with its own mask keyword
    "falcon_h1": dict(
        model_type="falcon_h1",
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_ssm=128,
        mamba_d_state=16,
        head_dim=16,
        perturb=0.02,
    ),
}


def make_tiny_model(folder: Path, model_type: str, seed: int = 0, perturb: float = 0.0, **overrides) -> Path:
    """``perturb``: add N(0, perturb) to every weight and saved float buffer (DeepSeek's expert-score correction
    bias), drawn from ``seed`` (norms initialised to 0 or 1, zero biases and zero-initialised MoE routers would
    otherwise hide mistakes, or tie the routers' choices)."""
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
            saved = set(model.state_dict())
            for name, b in model.named_buffers():
                if name in saved and b.is_floating_point():
                    b.add_(torch.randn_like(b) * perturb)
    model.save_pretrained(folder, max_shard_size="100KB")  # several shards, so selective reads are exercised
    return folder


class TinyModels(Mapping[str, Path]):
    """Each family's tiny model, saved the first time a test asks for it (most sessions need only a few)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.saved: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self.saved:
            cfg = dict(FAMILY_CONFIGS[family])
            folder = make_tiny_model(self.root / f"tiny-{family}", str(cfg.pop("model_type")), **cfg)
            constant = constant_tensors(folder)
            assert not constant, f"{family}: tensors with one value everywhere (perturb the weights): {constant}"
            self.saved[family] = folder
        return self.saved[family]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILY_CONFIGS)

    def __len__(self) -> int:
        return len(FAMILY_CONFIGS)


def constant_tensors(folder: Path) -> list[str]:
    """The saved tensors of more than one element that hold a single value (a norm of ones, a bias of zeros)."""
    from safetensors.torch import load_file

    found = []
    for file in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(file).items():
            if t.numel() > 1 and bool((t == t.flatten()[0]).all()):
                found.append(name)
    return found


def local_reference(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()
