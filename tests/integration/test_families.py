"""Each supported family, split over two real servers on loopback, equals a local Hugging Face run."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.models import FAMILY_CONFIGS, local_reference, make_tiny_model
from tests.helpers.swarms import (
    check_backward,
    check_forward,
    check_greedy,
    check_hidden_states,
    check_score,
    check_session_steps,
    connect,
    running_swarm,
)

# The fast subset's families (the full suite runs them all): a Llama over libp2p alone, GPT-2's other layout (fused
# attention, learned positions, tied head) over the direct plane, and DeepSeek-V3's latent attention and routed
# experts; and Phi-3, which no row of the family table lists. Each family's local math is checked without a swarm
# in tests/unit/test_family_layer.py (inferred families: tests/unit/test_family_infer.py).
# Phi-3 and OPT: families inferred from their class, not rows of the table (OPT's embeddings and head run through its
# own forward: ``swarm.families.own_forward``)
# ModernBERT-decoder: a module beside its base model and head, which the client holds (``shell.beside_of``)
# Families whose blocks differ in kind (Nemotron-H's state-space, attention, MoE and MLP blocks): LoRA refused
HYBRID_BLOCKS = ("nemotron_h",)
FAST = ("llama", "gpt2", "deepseek_v3", "phi3", "opt", "modernbert-decoder")


@pytest.fixture(
    scope="module",
    params=[f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILY_CONFIGS)],
)
def family_swarm(request, tiny_models):
    folder = tiny_models[request.param]
    with running_swarm(str(folder), ["0:2", "1:4"]) as swarm:  # overlapping spans: entered mid-span
        # half the families talk over libp2p only, half over the direct TCP data plane: both paths stay tested
        client = connect(str(folder), swarm, direct="never" if request.param in ("llama", "qwen2") else "auto")
        try:
            yield client, local_reference(folder), swarm
        finally:
            client.close()


def test_forward_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_forward(client, ref, ref.config.vocab_size)
    route = client.route
    assert [(h.start, h.end) for h in route] in ([(0, 1), (1, 4)], [(0, 2), (2, 4)])  # overlap: one side cut short
    assert len({h.peer_id for h in route}) == 2


def test_greedy_generation_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_greedy(client, ref, ref.config.vocab_size)


def test_threads_generate_at_once_each_in_its_own_session(family_swarm):
    """Four threads of one process generate at the same time on one model, as a script serving several people would:
    each in a session of its own (not another thread's), each equal to Hugging Face's greedy answer to its prompt."""
    client, ref, _ = family_swarm
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, ref.config.vocab_size, (1, 5 + 2 * i), generator=g) for i in range(4)]
    start = threading.Barrier(len(prompts))

    # no token is padding (a prompt may hold the id a family pads with: OPT's 1)
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    def generate(ids: torch.Tensor) -> torch.Tensor:
        start.wait()  # all four open their sessions together
        out: torch.Tensor = client.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        return out

    with ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(generate, prompts))
    for ids, got in zip(prompts, ours, strict=True):
        assert torch.equal(got, ref.generate(ids, attention_mask=torch.ones_like(ids), **gen))


def test_session_prefill_and_steps_match_local(family_swarm):
    client, ref, _ = family_swarm
    check_session_steps(client, ref, ref.config.vocab_size)


def test_backward_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_backward(client, ref, ref.config.vocab_size)


def test_lora_gradients_match_peft(family_swarm, tmp_path):
    """LoRA on the family's default targets (PEFT's): the adapter is saved in PEFT's format under the family's own
    layer path, loaded by PEFT onto a local model, and logits, loss and every LoRA gradient equal PEFT's."""
    from peft import PeftModel

    from swarm.errors import BadInputError

    _, ref, swarm = family_swarm
    if ref.config.model_type in HYBRID_BLOCKS:  # blocks of different kinds: refused before training, with the blocks
        with pytest.raises(BadInputError, match=r"blocks hold different targets .*block 0: none.*block \d+: "):
            connect(swarm.model, swarm, tuning="lora", lora_rank=2, lora_alpha=4)
        return
    with connect(swarm.model, swarm, tuning="lora", lora_rank=2, lora_alpha=4) as client:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-zero everywhere: PEFT starts B at zero, which would hide half the gradients
            for p in client.adapters.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        client.save_adapter(tmp_path)
        peft = PeftModel.from_pretrained(local_reference(swarm.model), str(tmp_path), is_trainable=True)
        torch.manual_seed(5)
        ids = torch.randint(0, ref.config.vocab_size, (2, 11))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        labels = ids.masked_fill(mask == 0, -100)
        ours = client(input_ids=ids, attention_mask=mask, labels=labels)
        ours.loss.backward()
        theirs = peft(input_ids=ids, attention_mask=mask, labels=labels)
        theirs.loss.backward()
        assert (ours.logits - theirs.logits)[mask.bool()].abs().max().item() < 1e-4
        assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5
        named = dict(peft.named_parameters())
        pairs = 0
        for block, layer in enumerate(client.adapters.lora):
            for path in client.adapters.targets:
                pair = layer[path.replace(".", "__")]
                for which, mine in (("A", pair.A), ("B", pair.B)):
                    suffix = re.compile(rf"\.{block}\.{re.escape(path)}\.lora_{which}\.default\.weight$")
                    (theirs_name,) = [n for n in named if suffix.search(n)]
                    grad = named[theirs_name].grad
                    assert mine.grad is not None and grad is not None and mine.grad.abs().sum() > 0
                    scale = max(1.0, grad.abs().max().item())
                    assert (mine.grad - grad).abs().max().item() <= 1e-5 * scale, theirs_name
                    pairs += 1
        assert pairs == 2 * len(client.adapters.targets) * ref.config.num_hidden_layers > 0


def test_scoring_and_hidden_states_match_local(family_swarm):
    """Two procedures that exist only as plans (no RPC of their own): scoring texts and extracting hidden states."""
    client, ref, _ = family_swarm
    check_score(client, ref, ref.config.vocab_size)
    check_hidden_states(client, ref, ref.config.vocab_size)


@pytest.mark.parametrize(
    "model_type, edit, why",
    [
        ("mpt", {}, "MptForCausalLM: its layers need position_bias, which its model computes around them"),
        pytest.param(
            "llama",
            {"architectures": ["NoSuchForCausalLM"]},
            "architecture 'NoSuchForCausalLM' is not a class",
            marks=pytest.mark.slow,  # each case starts a peer: the fast subset keeps the first
        ),
        pytest.param(
            "llama",
            {"quantization_config": {"quant_method": "fp8"}},
            "quantized weights \\(fp8\\): dequantize",
            marks=pytest.mark.slow,
        ),
        pytest.param("gpt2", {"add_cross_attention": True}, "cross-attention layers", marks=pytest.mark.slow),
    ],
)
def test_a_server_says_why_it_cannot_serve_a_model_and_exits_non_zero(model_type, edit, why, tmp_path):
    import json

    folder = make_tiny_model(tmp_path / model_type, model_type)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(RuntimeError, match="did not start \\(exit code 2\\)") as failed:
        with running_swarm(str(folder), ["0:2"]):
            pass
    assert re.search(f"error: .*{why}", str(failed.value)), str(failed.value)[-600:]
