"""The family layer inside the real parts, without swarms: the client's own modules and the server's runtime (spans
with their caches, a redone step, LoRA hooks) read from saved folders equal Hugging Face and PEFT; what cannot be
served exactly or tuned as PEFT would is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from swarm.client.model import DistributedModelForCausalLM
from swarm.errors import BadInputError
from swarm.families import local, weights
from swarm.families.selfcheck import TOLERANCE
from swarm.families.spec import family_of
from tests.helpers.families import FAMILIES, tiny_config


def saved_reference(name: str, folder: Path) -> PreTrainedModel:
    """A Hugging Face model of ``name``'s tiny config, weights perturbed (norms at 0 or 1 would hide mistakes),
    saved to ``folder`` in several shards."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(folder, max_shard_size="100KB")
    return ref


def loaded_client(folder: Path) -> DistributedModelForCausalLM:
    """The swarm client's own modules (not connected), read from ``folder`` as ``from_pretrained`` reads them."""
    from swarm.model_files import load_config, read_tensors, weight_map

    client = DistributedModelForCausalLM(load_config(folder))
    names = local.client_names(client.family, weight_map(folder))
    client._load_local({names[k]: v for k, v in read_tensors(folder, list(names)).items()})
    return client


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_neox", "bloom", "qwen3_moe"])
def test_client_local_parts_match_hugging_face(name, tmp_path):
    """The swarm client's own modules (``DistributedModelForCausalLM``, not connected) read from a saved folder:
    embeddings (Gemma's scale, BLOOM's norm) and head (final norm under the family's name, soft-cap) as HF's."""
    ref = saved_reference(name, tmp_path)
    client = loaded_client(tmp_path)
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

    from peers.blocks.serving_stage import ServingStage
    from peers.serving.config import ComputeConfig
    from tests.helpers.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match="quantized weights \\(fp8\\)"):
        ServingStage.from_config(str(folder), ComputeConfig(), tmp_path)


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
    from peers.blocks.backend import SpanBackend
    from peers.blocks.families import family_for
    from peers.blocks.loader import load_span
    from peers.serving.kv_cache import rewind
    from swarm.ids import Span
    from swarm.model_files import load_config

    ref = saved_reference(name, tmp_path)
    family = family_for(load_config(tmp_path))
    spans = [Span(0, 2), Span(2, 4)]
    backends = [
        SpanBackend(
            family.config, family, load_span(tmp_path, family, s, torch.float32, "cpu"), s, "cpu", torch.float32
        )
        for s in spans
    ]
    client = loaded_client(tmp_path)
    ids = torch.randint(1, 320, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    caches = [b.new_cache() for b in backends]

    def step(tokens: torch.Tensor, past: int) -> torch.Tensor:
        positions = torch.arange(past, past + tokens.shape[1]).unsqueeze(0).expand(2, -1)
        hidden = client.embed(tokens, positions)
        for backend, cache in zip(backends, caches, strict=True):
            hidden = backend.run(
                hidden, backend.span, attention_mask=mask[:, : past + tokens.shape[1]], cache=cache, past=past
            )
        return client.head(hidden)

    def settle() -> None:
        for cache in caches:
            rewind(cache, 0)  # as the server does before every new step: sliding layers give back what they kept

    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = [step(ids[:, :9], 0)]
        # The next step is sent again after a repair upstream, with other input: the server forgets the first try
        # (past every sliding window here: 9 tokens, windows of 8) and redoes it.
        settle()
        step(torch.randint(1, 320, (2, 2)), 9)
        for cache in caches:
            rewind(cache, 2)
        got.append(step(ids[:, 9:11], 9))
        for t in (11, 12):
            settle()
            got.append(step(ids[:, t : t + 1], t))
    assert (torch.cat(got, dim=1) - want)[mask.bool()].abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_reader_s_own_run_of_a_span_matches_hugging_face(name, tmp_path):
    """``swarm.families.recompute``: what a reader holding the weights judges an accusation by, one block at a time
    from the folder, gives Hugging Face's logits between the client's own modules, and in two spans what it gives
    in one."""
    from peers.blocks.families import family_for
    from swarm.families.recompute import recompute
    from swarm.model_files import load_config

    ref = saved_reference(name, tmp_path)
    family = family_for(load_config(tmp_path))
    client = loaded_client(tmp_path)
    ids = torch.randint(1, 320, (2, 11))
    with torch.no_grad():
        hidden = client.embed(ids, torch.arange(11).unsqueeze(0).expand(2, -1))
        whole = recompute(family, tmp_path, hidden, 0, 4)
        halves = recompute(family, tmp_path, recompute(family, tmp_path, hidden, 0, 2), 2, 4)
        want = ref(ids).logits
        assert (client.head(whole) - want).abs().max().item() < TOLERANCE
    assert torch.allclose(whole, halves, atol=1e-5)
    with pytest.raises(ValueError, match="blocks 3:9"):
        recompute(family, tmp_path, hidden, 3, 9)


def test_original_gpt2_files_without_the_base_prefix_load(tmp_path):
    """The original GPT-2 and BLOOM checkpoints name tensors ``h.0.…``, ``wte.weight`` (no ``transformer.``) and
    carry legacy ``attn.bias`` buffers: layers and local parts still load, the buffers are dropped."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

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
    names = local.client_names(client.family, weight_map(tmp_path))
    assert sorted(names.values()) == ["model.ln_f.bias", "model.ln_f.weight", "model.wpe.weight", "model.wte.weight"]
    client._load_local({names[k]: v for k, v in read_tensors(tmp_path, list(names)).items()})
    assert torch.equal(client.lm_head.weight, ref.lm_head.weight)  # tied


@pytest.mark.parametrize("name, targets", [("gpt2", ("c_attn",)), ("bloom", ("query_key_value",))])
def test_server_lora_equals_peft(name, targets):
    """A server's LoRA hooks on the family's default targets (GPT-2's Conv1D with PEFT's fan_in_fan_out, BLOOM's fused
    query_key_value) give the same block outputs as PEFT's LoRA on Hugging Face's model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peers.blocks.backend import SpanBackend
    from peers.serving.adapters import Adapter
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


@pytest.mark.parametrize("name", ["gpt2", "bloom"])
def test_prompt_tuning_is_refused_where_it_would_differ_from_peft(name):
    """GPT-2's learned positions and BLOOM's embedding norm apply to PEFT's prompts too, not to the swarm's."""
    from swarm.tuning import TuningSpec

    client = DistributedModelForCausalLM(tiny_config(name))
    for mode in ("prompt", "deep_prompt"):
        with pytest.raises(BadInputError, match=f"{mode} tuning is not supported for {name}"):
            client._attach_adapters(TuningSpec(mode, num_prompt_tokens=2), None)
    client._attach_adapters(TuningSpec("lora", lora_targets=client.family.spec.lora_defaults), None)
    assert client.adapters is not None
