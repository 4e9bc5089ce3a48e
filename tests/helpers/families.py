"""Each served family's tiny config, without weights: what the family layer's, the runtimes' and batching's unit tests
build layers and local reference models from (``tiny_config("gemma2")``). The saved tiny models of the swarm tests
are ``tests.helpers.models``."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=320, tie_word_embeddings=False)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
FAMILIES: dict[str, dict[str, object]] = {
    "llama": dict(model_type="llama", intermediate_size=128, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", intermediate_size=128, num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(model_type="qwen2", intermediate_size=128, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "mixtral": dict(
        model_type="mixtral", intermediate_size=128, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "gemma2": dict(
        model_type="gemma2",
        intermediate_size=128,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        intermediate_size=128,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=ALTERNATING,
        final_logit_softcapping=20.0,
    ),
    "gpt2": dict(
        model_type="gpt2", n_inner=128, n_positions=256, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True
    ),
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=128, rotary_pct=0.25, use_parallel_residual=True),
    "falcon": dict(model_type="falcon", num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, alibi=False),
    "falcon_alibi": dict(
        model_type="falcon", multi_query=True, new_decoder_architecture=False, parallel_attn=True, alibi=True
    ),
    "bloom": dict(model_type="bloom"),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=16,
        mlp_only_layers=[0],
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        intermediate_size=128,
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
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        intermediate_size=64,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=ALTERNATING,
    ),
}


def tiny_config(name: str) -> PretrainedConfig:
    kwargs = {**BASE, **FAMILIES[name]}
    return AutoConfig.for_model(str(kwargs.pop("model_type")), **kwargs)
