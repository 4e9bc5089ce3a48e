"""The family layer (``swarm.families``) without swarms: for every family, the split path (client embeddings, layers
in two spans with their own caches, client head) equals Hugging Face's logits on a full forward, a left-padded batch
and cached decode; wrong choices are refused by the self-check; layers load from saved folders; cache bytes match
what transformers' caches hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from swarm.errors import BadInputError
from swarm.families import kv, local, weights
from swarm.families.selfcheck import TOLERANCE, check_split, require_exact
from swarm.families.spec import SPECS, family_of

BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=320, tie_word_embeddings=False)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
FAMILIES: dict[str, dict[str, object]] = {
    "llama": dict(model_type="llama", intermediate_size=128, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", intermediate_size=128, num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(model_type="qwen2", intermediate_size=128, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "mixtral": dict(model_type="mixtral", intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2),
    "gemma2": dict(model_type="gemma2", intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=128, num_key_value_heads=2, head_dim=16,
                        sliding_window=8, query_pre_attn_scalar=16, layer_types=ALTERNATING,
                        final_logit_softcapping=20.0),
    "gpt2": dict(model_type="gpt2", n_inner=128, n_positions=256, bos_token_id=0, eos_token_id=0,
                 tie_word_embeddings=True),
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=128, rotary_pct=0.25, use_parallel_residual=True),
    "falcon": dict(model_type="falcon", num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True,
                   alibi=False),
    "falcon_alibi": dict(model_type="falcon", multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                         alibi=True),
    "bloom": dict(model_type="bloom"),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, num_key_value_heads=2, head_dim=16, mlp_only_layers=[0]),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        n_shared_experts=1, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=64, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=ALTERNATING),
}  # fmt: skip


def tiny_config(name: str) -> PretrainedConfig:
    kwargs = {**BASE, **FAMILIES[name]}
    return AutoConfig.for_model(str(kwargs.pop("model_type")), **kwargs)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_split_path_equals_hugging_face(name):
    report = check_split(tiny_config(name), twin=False)
    assert report.ok, report.problems
    assert set(report.diffs) == {"full forward", "left-padded batch", "cached decode"}
    assert max(report.diffs.values()) <= TOLERANCE


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "deepseek_v3", "falcon_alibi"])
def test_self_check_on_a_shrunk_twin_of_a_bigger_config(name):
    config = tiny_config(name)
    config.hidden_size, config.num_hidden_layers = 128, 6
    if getattr(config, "layer_types", None):
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    assert check_split(config).ok
    assert require_exact(config).label == family_of(config).label


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
    from peers.kv_cache import KvCost

    cost = KvCost(family_of(tiny_config(name)), 2)
    budget = cost.budget_for(100, 2)  # --cache-tokens 100 on a peer that may serve 2 blocks
    for start, end in ((0, 2), (1, 3), (2, 4)):
        tokens = cost.tokens_within(start, end, budget)
        assert tokens >= 100 and cost.session_bytes(start, end, 1, tokens) <= budget
        if tokens < 1 << 40:  # else the span has only sliding layers: any context fits once their windows do
            assert cost.session_bytes(start, end, 1, tokens + 1) > budget
        assert cost.session_bytes(start, end, 3, 50) == kv.cache_bytes(cost.family, range(start, end), 50, 2, 3)


def test_latent_and_sliding_caches_cost_less_than_grouped_query_heads():
    from peers.kv_cache import KvCost

    def per_token(name: str) -> int:  # bytes per token of a long context through all four blocks
        cost = KvCost(family_of(tiny_config(name)), 2)
        return cost.session_bytes(0, 4, 1, 1001) - cost.session_bytes(0, 4, 1, 1000)

    # llama: 2 kv heads x 16 x (k, v) per layer; DeepSeek's latent: kv_lora_rank + rope dims; Gemma 3: half the
    # layers slide (their windows are paid once)
    assert per_token("llama") == 4 * 2 * 2 * 16 * 2
    deepseek = FAMILIES["deepseek_v3"]
    assert per_token("deepseek_v3") == 4 * (int(deepseek["kv_lora_rank"]) + int(deepseek["qk_rope_head_dim"])) * 2
    assert per_token("gemma3_text") == per_token("gemma2") == 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_neox", "bloom", "qwen3_moe"])
def test_client_local_parts_match_hugging_face(name, tmp_path):
    """The swarm client's own modules (``DistributedModelForCausalLM``, not connected) read from a saved folder:
    embeddings (Gemma's scale, BLOOM's norm) and head (final norm under the family's name, soft-cap) as HF's."""
    from transformers import AutoModelForCausalLM

    from swarm.client.model import DistributedModelForCausalLM
    from swarm.model_files import load_config, read_tensors, weight_map

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    client = DistributedModelForCausalLM(load_config(tmp_path))
    names = client._disk_names(weight_map(tmp_path))
    client._load_local({names[k]: v for k, v in read_tensors(tmp_path, list(names)).items()})
    norm_input: list[torch.Tensor] = []
    family = client.family
    norm = getattr(getattr(ref, family.base_prefix), family.spec.norm)
    norm.register_forward_hook(lambda m, args, out: norm_input.append(args[0]))
    ids = torch.randint(1, 320, (2, 7))
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
        assert torch.allclose(client.embed(ids), out.hidden_states[0], atol=1e-6)
        assert torch.allclose(client.head(norm_input[-1]), out.logits, atol=1e-5)
    assert not any(t.is_meta for t in [*client.parameters(), *client.buffers()])


def test_a_server_refuses_at_start_what_it_cannot_serve_exactly(tmp_path):
    """A quantized checkpoint (FP8 DeepSeek, MXFP4 GPT-OSS) is refused by the serving stage, naming why."""
    import json

    from peers.config import PeerConfig
    from peers.stage import ServingStage
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match="quantized weights \\(fp8\\)"):
        ServingStage.from_config(PeerConfig(model=str(folder), cache_dir=tmp_path))


def test_gpt2_conv1d_layers_are_lora_targets():
    from swarm.tuning import linear_modules

    with torch.device("meta"):
        block = family_of(tiny_config("gpt2")).build_layer(0)
    assert linear_modules(block)["attn.c_attn"] == (64, 192)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_server_runtime_matches_hugging_face(name, tmp_path):
    """The server's own path (``load_span`` from a saved folder, ``SpanBackend.run`` in two spans with their caches)
    between the client's own modules: a padded prefill, a step redone (as after a repair upstream) and single-token
    steps equal Hugging Face's logits."""
    from transformers import AutoModelForCausalLM

    from peers.blocks.backend import SpanBackend
    from peers.blocks.families import family_for
    from peers.blocks.loader import load_span
    from peers.rpc.sessions import _rewind
    from swarm.client.model import DistributedModelForCausalLM
    from swarm.ids import Span
    from swarm.model_files import load_config, read_tensors, weight_map

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    family = family_for(load_config(tmp_path))
    spans = [Span(0, 2), Span(2, 4)]
    backends = [SpanBackend(family.config, family, load_span(tmp_path, family, s, torch.float32, "cpu"), s, "cpu",
                            torch.float32) for s in spans]  # fmt: skip
    client = DistributedModelForCausalLM(load_config(tmp_path))
    names = client._disk_names(weight_map(tmp_path))
    client._load_local({names[k]: v for k, v in read_tensors(tmp_path, list(names)).items()})
    ids = torch.randint(1, 320, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    caches = [b.new_cache() for b in backends]

    def step(tokens: torch.Tensor, past: int) -> torch.Tensor:
        positions = torch.arange(past, past + tokens.shape[1]).unsqueeze(0).expand(2, -1)
        hidden = client.embed(tokens, positions)
        for backend, cache in zip(backends, caches, strict=True):
            hidden = backend.run(hidden, backend.span, attention_mask=mask[:, : past + tokens.shape[1]],
                                 cache=cache, past=past)  # fmt: skip
        return client.head(hidden)

    def settle() -> None:
        for cache in caches:
            _rewind(cache, 0)  # as the server does before every new step: sliding layers give back what they kept

    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = [step(ids[:, :9], 0)]
        # The next step is sent again after a repair upstream, with other input: the server forgets the first try
        # (past every sliding window here: 9 tokens, windows of 8) and redoes it.
        settle()
        step(torch.randint(1, 320, (2, 2)), 9)
        for cache in caches:
            _rewind(cache, 2)
        got.append(step(ids[:, 9:11], 9))
        for t in (11, 12):
            settle()
            got.append(step(ids[:, t : t + 1], t))
    assert (torch.cat(got, dim=1) - want)[mask.bool()].abs().max().item() < TOLERANCE


def test_original_gpt2_files_without_the_base_prefix_load(tmp_path):
    """The original GPT-2 and BLOOM checkpoints name tensors ``h.0.…``, ``wte.weight`` (no ``transformer.``) and
    carry legacy ``attn.bias`` buffers: layers and local parts still load, the buffers are dropped."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from swarm.client.model import DistributedModelForCausalLM
    from swarm.model_files import load_config, read_tensors, weight_map

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config("gpt2"), dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    bare.update({f"h.{i}.attn.bias": torch.ones(1, 1, 8, 8) for i in range(4)})
    save_file(bare, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    family = family_of(load_config(tmp_path))
    layer = weights.load_layer(family, tmp_path, 1, torch.float32, "cpu")
    want = ref.transformer.h[1].state_dict()
    assert all(torch.equal(layer.state_dict()[k], want[k]) for k in want)
    client = DistributedModelForCausalLM(load_config(tmp_path))
    names = client._disk_names(weight_map(tmp_path))
    assert sorted(names.values()) == ["model.ln_f.bias", "model.ln_f.weight", "model.wpe.weight", "model.wte.weight"]
    client._load_local({names[k]: v for k, v in read_tensors(tmp_path, list(names)).items()})
    assert torch.equal(client.lm_head.weight, ref.lm_head.weight)  # tied


@pytest.mark.parametrize("name, targets", [("gpt2", ("c_attn",)), ("bloom", ("query_key_value",))])
def test_server_lora_equals_peft(name, targets):
    """A server's LoRA hooks on the family's default targets (GPT-2's Conv1D with PEFT's fan_in_fan_out, BLOOM's fused
    query_key_value) give the same block outputs as PEFT's LoRA on Hugging Face's model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peers.adapters import Adapter
    from peers.blocks.backend import SpanBackend
    from swarm.ids import Span

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    family = family_of(ref.config)
    layers = getattr(getattr(ref, family.base_prefix), family.layers_attr)
    span = Span(0, family.num_layers)
    backend = SpanBackend(family.config, family, torch.nn.ModuleList(list(layers)), span, "cpu", torch.float32)
    lora, scaling = {}, 2.0
    for block in range(family.num_layers):
        for path, (fan_in, fan_out) in backend.linears.items():
            if path.rsplit(".", 1)[-1] in targets:
                lora[(block, path)] = (torch.randn(4, fan_in) * 0.1, torch.randn(fan_out, 4) * 0.1)
    assert lora
    hidden = torch.randn(2, 6, 64)
    with torch.no_grad():
        ours = backend.run(hidden, span, adapter=Adapter(scaling, lora))
        assert (ours - backend.run(hidden, span)).abs().max().item() > 1e-3  # the adapter does something
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), fan_in_fan_out=name == "gpt2")
    peft = get_peft_model(ref, config)
    for (block, path), (a, b) in lora.items():
        module = layers[block].get_submodule(path)
        module.lora_A["default"].weight.data.copy_(a)
        module.lora_B["default"].weight.data.copy_(b)
    with torch.no_grad():
        theirs = backend.run(hidden, span)  # the same layers, now wrapped by PEFT
    assert peft is not None and (ours - theirs).abs().max().item() < 1e-5


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


@pytest.mark.parametrize("name", ["gpt2", "bloom"])
def test_prompt_tuning_is_refused_where_it_would_differ_from_peft(name):
    """GPT-2's learned positions and BLOOM's embedding norm apply to PEFT's prompts too, not to the swarm's."""
    from swarm.client.model import DistributedModelForCausalLM
    from swarm.tuning import TuningSpec

    client = DistributedModelForCausalLM(tiny_config(name))
    for mode in ("prompt", "deep_prompt"):
        with pytest.raises(BadInputError, match=f"{mode} tuning is not supported for {name}"):
            client._attach_adapters(TuningSpec(mode, num_prompt_tokens=2), None)
    client._attach_adapters(TuningSpec("lora", lora_targets=client.family.spec.lora_defaults), None)
    assert client.adapters is not None
