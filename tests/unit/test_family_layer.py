"""The family layer (``swarm.families``) without swarms: for every family, the split path (client embeddings, layers
in two spans with their own caches, client head) equals Hugging Face's logits on a full forward, a left-padded batch
and cached decode; wrong choices are refused by the self-check; layers load from saved folders; cache bytes match
what transformers' caches hold."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from swarm.errors import BadInputError
from swarm.families import kv, local, weights
from swarm.families.selfcheck import TOLERANCE, TOLERANCES, check_split, require_exact
from swarm.families.spec import SPECS, family_of
from tests.helpers.families import FAMILIES, tiny_config


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_split_path_equals_hugging_face(name):
    report = check_split(tiny_config(name), twin=False)
    assert report.ok, report.problems
    assert set(report.diffs) == {"full forward", "left-padded batch", "cached decode"}
    assert max(report.diffs.values()) <= TOLERANCE


REFUSED_IN_BFLOAT16 = {"deepseek_v3", "gpt_oss"}  # 0.15 off from block 0 in bfloat16 (swarm.families.selfcheck)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_split_path_in_16_bits_within_the_dtypes_bound_or_refused_with_the_reason(name, dtype):
    report = check_split(tiny_config(name), twin=False, dtype=dtype)
    if dtype == torch.bfloat16 and name in REFUSED_IN_BFLOAT16:
        assert not report.ok and "full forward: logits off by" in report.problems[0]
        return
    assert report.ok, report.problems
    assert 0 <= max(report.diffs.values()) <= TOLERANCES[dtype]


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "deepseek_v3", "falcon_alibi"])
def test_self_check_on_a_shrunk_twin_of_a_bigger_config(name):
    config = tiny_config(name)
    config.hidden_size, config.num_hidden_layers = 128, 6
    if getattr(config, "layer_types", None):
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    assert check_split(config).ok
    assert require_exact(config).label == family_of(config).label


def test_a_config_that_matched_is_not_checked_again_in_the_process(monkeypatch):
    from swarm.families import selfcheck

    monkeypatch.setattr(selfcheck, "_MATCHED", set())
    checked: list[PretrainedConfig] = []
    real = selfcheck.check_split
    monkeypatch.setattr(selfcheck, "check_split", lambda config: checked.append(config) or real(config))
    config = tiny_config("qwen2")
    require_exact(config)
    assert require_exact(copy.deepcopy(config)).label == "qwen2"
    assert len(checked) == 1  # the same config again: matched already
    config.rms_norm_eps = 1e-5
    require_exact(config)
    assert len(checked) == 2  # another config: its own twin


def test_the_family_is_found_from_the_architecture_not_the_model_type():
    config = tiny_config("gemma3_text")
    assert family_of(config).lm_class.__name__ == "Gemma3ForCausalLM"
    config.architectures = ["Gemma3ForCausalLM"]
    assert family_of(config).label == "gemma3_text"
    config.architectures = ["NoSuchForCausalLM"]
    with pytest.raises(BadInputError, match="NoSuchForCausalLM"):
        family_of(config)


def test_attention_is_the_one_the_family_supports():
    assert family_of(tiny_config("gemma2")).config._attn_implementation == "eager"
    assert family_of(tiny_config("gpt_oss")).config._attn_implementation == "eager"
    assert family_of(tiny_config("bloom")).config._attn_implementation == "eager"
    assert family_of(tiny_config("llama")).config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "name, broken, what",
    [
        ("gpt_oss", dict(attn="sdpa"), "off by"),  # sdpa silently drops the attention sinks
        ("bloom", dict(attn="sdpa"), "off by"),  # a boolean mask where BLOOM adds a float one
        ("gpt2", dict(positions=None), "the client's embeddings"),  # learned positions never added
        ("gpt_neox", dict(call="decoder"), "cached decode"),  # cache= instead of layer_past=: nothing cached
        ("gemma3_text", dict(rotary="shared"), "off by|TypeError"),  # one rotary where each layer type has its own
        ("gemma2", dict(norm="missing"), "AttributeError|building"),
    ],
)
def test_the_self_check_refuses_a_broken_family(name, broken, what):
    config = tiny_config(name)
    spec = SPECS[family_of(config).lm_class.__name__]
    attn = broken.pop("attn", None)
    report = check_split(config, spec=dataclasses.replace(spec, **broken), attn=attn, twin=False)  # type: ignore[arg-type]
    assert not report.ok
    assert any(__import__("re").search(what, p) for p in report.problems), report.problems


def test_declared_unsupported_settings_are_refused():
    config = tiny_config("llama")
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(BadInputError, match="quantized weights \\(fp8\\)"):
        require_exact(config)
    gpt2 = tiny_config("gpt2")
    gpt2.add_cross_attention = True
    with pytest.raises(BadInputError, match="cross-attention"):
        family_of(gpt2)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gpt2", "gpt_neox", "gemma2"])
def test_layers_and_local_parts_load_from_a_saved_folder(name, tmp_path):
    """What ``save_pretrained`` writes (per-expert files, NeoX's ``embed_out``, tied heads) loads into the same math."""
    from transformers import AutoModelForCausalLM

    from swarm.model_files import read_tensors, weight_map

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    family = family_of(ref.config)
    ref_layers = getattr(getattr(ref, family.base_prefix), family.layers_attr)
    sizes = weights.block_bytes(family, tmp_path, torch.float32)
    for i in range(family.num_layers):
        layer = weights.load_layer(family, tmp_path, i, torch.float32, "cpu")
        want = ref_layers[i].state_dict()
        got = layer.state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert sizes[i] == sum(t.numel() * 4 for t in want.values() if t.is_floating_point())
    model = local.local_model(family)
    names = local.disk_to_local(family, weight_map(tmp_path), model)
    state = {names[k]: v for k, v in read_tensors(tmp_path, list(names)).items()}
    local.load_local(family, model, state)
    ids = torch.randint(1, 320, (1, 5))
    with torch.no_grad():
        hidden = local.embed(family, local.base_of(family, model), ids)
        assert torch.allclose(hidden, ref(ids, output_hidden_states=True).hidden_states[0], atol=1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cache_bytes_match_what_transformers_caches(name):
    from transformers import AutoModelForCausalLM, DynamicCache

    config = tiny_config(name)
    family = family_of(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    context = 14
    with torch.no_grad():
        model(torch.randint(1, 320, (1, context)), cache=cache, use_cache=True)
    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    assert kv.cache_bytes(family, range(family.num_layers), context, 1) == held


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_budget_in_bytes_holds_the_tokens_it_announces(name):
    """A server's KV budget is bytes; what it announces (tokens of context through its span) and what a session
    reserves (its family's bytes for batch x max_length) agree with ``kv.cache_bytes`` to the token."""
    from peers.serving.kv_cache import KvCost

    cost = KvCost(family_of(tiny_config(name)), 2)
    budget = cost.budget_for(100, 2)  # --cache-tokens 100 on a peer that may serve 2 blocks
    for start, end in ((0, 2), (1, 3), (2, 4)):
        tokens = cost.tokens_within(start, end, budget)
        assert tokens >= 100 and cost.session_bytes(start, end, 1, tokens) <= budget
        if tokens < 1 << 40:  # else the span has only sliding layers: any context fits once their windows do
            assert cost.session_bytes(start, end, 1, tokens + 1) > budget
        assert cost.session_bytes(start, end, 3, 50) == kv.cache_bytes(cost.family, range(start, end), 50, 2, 3)


def test_latent_and_sliding_caches_cost_less_than_grouped_query_heads():
    from peers.serving.kv_cache import KvCost

    def per_token(name: str) -> int:  # bytes per token of a long context through all four blocks
        cost = KvCost(family_of(tiny_config(name)), 2)
        return cost.session_bytes(0, 4, 1, 1001) - cost.session_bytes(0, 4, 1, 1000)

    # llama: 2 kv heads x 16 x (k, v) per layer; DeepSeek's latent: kv_lora_rank + rope dims; Gemma 3: half the
    # layers slide (their windows are paid once)
    assert per_token("llama") == 4 * 2 * 2 * 16 * 2
    deepseek = FAMILIES["deepseek_v3"]
    assert per_token("deepseek_v3") == 4 * (int(deepseek["kv_lora_rank"]) + int(deepseek["qk_rope_head_dim"])) * 2
    assert per_token("gemma3_text") == per_token("gemma2") == 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize(
    "model_type", ["llama", "gemma2", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_moe", "falcon"]
)
def test_self_check_passes_on_full_size_default_configs(model_type):
    """The released shapes (transformers' default configs: DeepSeek-V3's 61 layers and 256 experts, Gemma 3's 5:1
    sliding pattern) are checked on their shrunk twins in well under a second, and their cache bytes are counted."""
    config = AutoConfig.for_model(model_type)
    report = check_split(config)
    assert report.ok, report.problems
    family = family_of(config)
    assert kv.bytes_per_token(family, range(family.num_layers), 2) > 0
    if model_type == "deepseek_v3":  # the latent and the rotary key per layer, not 128 heads of 192 + 128
        assert kv.elements_per_token(family, 5) == 512 + 64
