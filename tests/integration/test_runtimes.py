"""One chain, two runtimes: blocks 0:2 on a torch server and 2:4 on an ONNX Runtime server (``--runtime onnx``) equal
a local Hugging Face run; the ONNX server announces its runtime and capabilities, and refuses what it cannot do (a
backward, a forward kept for one, an adapter) with a clear error while it keeps serving."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.config import Timing
from swarm.errors import BadInputError, MissingBlocksError
from swarm.hop import Hop
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import ALL_CAPABILITIES, Capability
from tests.helpers.models import local_reference
from tests.helpers.swarms import check_forward, check_greedy, check_session_steps, connect, raw_call, running_swarm

HIDDEN = 64
# SmolLM2's logits (up to ~34 in size) through 10 blocks on ONNX Runtime differ from Hugging Face's by 5e-5 at most
# (measured; all 30 blocks on ONNX: 1.05e-4): float32 sums in another order. The bound leaves room for other CPUs'
# kernels; the tiny model stays within the suite's usual 1e-4.
SMOLLM_TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def mixed(tiny_models):
    folder = tiny_models["llama"]
    with running_swarm(str(folder), ["0:2"]) as swarm:
        swarm.add_peer("2:4", "--runtime", "onnx")
        client = connect(str(folder), swarm)
        try:
            yield client, local_reference(folder), swarm
        finally:
            client.close()


def _records(client) -> dict[tuple[int, int], object]:
    return {(r.start, r.end): r for r in client.connection.view.servers()}


def test_the_onnx_server_announces_its_runtime_and_capabilities(mixed):
    client, _, _ = mixed
    records = _records(client)
    assert records[(0, 2)].runtime == "torch" and records[(0, 2)].capabilities == ALL_CAPABILITIES
    assert records[(2, 4)].runtime == "onnx"
    assert records[(2, 4)].capabilities == {Capability.INFERENCE, Capability.FORWARD}


def test_a_chain_of_torch_and_onnx_equals_hugging_face(mixed):
    client, ref, _ = mixed
    vocab = ref.config.vocab_size
    check_forward(client, ref, vocab)  # logits of a 2 x 37 batch within 1e-4
    records = _records(client)
    assert [(h.start, h.end, h.peer_id) for h in client.route] == [
        (0, 2, records[(0, 2)].peer_id),
        (2, 4, records[(2, 4)].peer_id),
    ]
    check_greedy(client, ref, vocab)  # 32 tokens, identical
    check_session_steps(client, ref, vocab)  # a prefill and 8 single-token steps in one session


@pytest.mark.slow  # the fast subset keeps the chain's forward, generation and session
def test_a_padded_batch_generates_what_hugging_face_does(mixed):
    client, ref, _ = mixed
    torch.manual_seed(5)
    ids = torch.randint(1, ref.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding
    ours = client.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    theirs = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def _onnx_hop(client) -> Hop:
    with torch.no_grad():  # with gradients the client would ask servers to keep the forward, which ONNX cannot
        client(torch.tensor([[1, 2]]))
    hop = client.route[-1]
    assert (hop.start, hop.end) == (2, 4)
    return hop


def _call(client, hop: Hop, meta: dict, tensors: dict):
    return raw_call(client, hop, dict({"protocol_version": PROTOCOL_VERSION, "start": 2, "end": 4}, **meta), tensors)


def test_the_onnx_server_refuses_training_and_adapters_and_keeps_serving(mixed):
    client, ref, _ = mixed
    hop = _onnx_hop(client)
    hidden = torch.randn(1, 3, HIDDEN)
    adapter = {"client": "c" * 64, "version": 0, "has_tensors": True, "scaling": 1.0}
    lora = {"lora.2.self_attn.q_proj.A": torch.zeros(2, HIDDEN), "lora.2.self_attn.q_proj.B": torch.zeros(HIDDEN, 2)}
    with pytest.raises(BadInputError, match="keep_for_backward.*'backward' capability.*onnx runtime lacks"):
        _call(client, hop, {"kind": "forward", "keep_for_backward": True, "forward_id": "f1"}, {"hidden": hidden})
    with pytest.raises(BadInputError, match="a backward pass needs the 'backward' capability"):
        _call(client, hop, {"kind": "backward", "forward_id": "f1"}, {"grad_output": hidden, "hidden": hidden})
    with pytest.raises(BadInputError, match="adapter.*'adapters' capability.*it has: forward, inference"):
        _call(client, hop, {"kind": "forward", "adapter": adapter}, {"hidden": hidden, **lora})
    # a plain forward is served: the blocks' output, as the torch server of the same blocks would give it
    out = _call(client, hop, {"kind": "forward"}, {"hidden": hidden})["hidden"]
    with torch.no_grad():
        pos = torch.arange(3).unsqueeze(0)
        cos_sin = ref.model.rotary_emb(hidden, pos)
        expected = hidden
        for layer in ref.model.layers[2:4]:
            expected = layer(expected, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    assert (out - expected).abs().max().item() < 1e-5
    # ...and the swarm still generates what Hugging Face does
    check_greedy(client, ref, ref.config.vocab_size, new_tokens=8)


@pytest.mark.slow  # a LoRA client of its own
def test_without_a_backward_capable_server_a_forward_runs_and_its_backward_fails_clearly(mixed, tiny_models):
    """Blocks 2:4 are held by the ONNX server only. A forward under grad mode (no ``no_grad``) still runs there; a
    backward through it is a clear error, never gradients that skip those blocks; a LoRA client, which needs
    ``adapters``, is told that no server can take its blocks."""
    client, ref, swarm = mixed
    ids = torch.randint(0, 320, (1, 6))
    out = client(ids, labels=ids)
    with torch.no_grad():
        assert (out.logits - ref(ids).logits).abs().max().item() < 1e-4
    with pytest.raises(BadInputError, match="cannot run a backward pass.*onnx"):
        out.loss.backward()

    # the client waits 2 s for capable servers to appear, not the tests' 12: what is checked here is the error
    timing = dataclasses.replace(Timing.for_tests(), missing_blocks_wait=2.0)
    with connect(str(tiny_models["llama"]), swarm, tuning="lora", timing=timing) as tuned:
        with pytest.raises(MissingBlocksError) as info:
            tuned(ids, labels=ids)
        assert info.value.blocks == [2, 3]


@pytest.fixture(scope="module")
def replicated(tiny_models):
    """Every block on a torch server and on an ONNX server."""
    folder = tiny_models["llama"]
    with running_swarm(str(folder), ["0:4"]) as swarm:
        swarm.add_peer("0:4", "--runtime", "onnx")
        yield swarm, folder


@pytest.mark.slow  # a swarm of its own, with an ONNX export
def test_routes_that_need_a_capability_skip_servers_without_it(replicated):
    swarm, folder = replicated
    torch.manual_seed(7)
    ids = torch.randint(0, 320, (2, 6))
    ref = local_reference(folder)
    with connect(str(folder), swarm, tuning="lora") as client:
        onnx = {r.peer_id for r in client.connection.view.servers() if r.runtime == "onnx"}
        assert len(onnx) == 1
        for _ in range(3):  # a fine-tuning step: kept forwards, backwards and the adapter: torch servers only
            loss = client.train_step(ids, torch.optim.SGD([p for p in client.parameters() if p.requires_grad], 0.1))
            assert loss > 0
            plan = client.last_plan
            assert plan is not None and plan.task == "finetune"
            assert all(n.runtime == "torch" and n.peer not in onnx for n in plan.remote())
    with connect(str(folder), swarm) as client:
        with torch.no_grad():  # inference needs neither: either server may serve it, and the outputs agree
            check_forward(client, ref, ref.config.vocab_size)
        ids = torch.randint(0, 320, (1, 5))
        client(ids, labels=ids).loss.backward()  # a forward kept for a backward: torch only
        assert client.last_plan is not None and all(n.peer not in onnx for n in client.last_plan.remote())


@pytest.mark.slow
def test_smollm_with_an_onnx_server_in_the_middle_equals_hugging_face(smollm_folder):
    """The real model: blocks 10:20 on ONNX Runtime between two torch servers."""
    from swarm import load_tokenizer

    model = "smollm2-135m"
    with running_swarm(model, ["0:10", "20:30"]) as swarm:
        swarm.add_peer("10:20", "--runtime", "onnx")
        ref = local_reference(smollm_folder)
        with connect(model, swarm) as client:
            check_forward(client, ref, ref.config.vocab_size, tol=SMOLLM_TOLERANCE)
            assert [(h.start, h.end) for h in client.route] == [(0, 10), (10, 20), (20, 30)]
            assert _records(client)[(10, 20)].runtime == "onnx"
            check_session_steps(client, ref, ref.config.vocab_size, tol=SMOLLM_TOLERANCE)
            tokenizer = load_tokenizer(model)
            tokenizer.padding_side = "left"
            batch = tokenizer(
                ["Hello, my name is", "The three primary colors are red, yellow and"], return_tensors="pt", padding=True
            )
            ours = client.generate(**batch, max_new_tokens=16, do_sample=False)
            theirs = ref.generate(**batch, max_new_tokens=16, do_sample=False)
            assert torch.equal(ours, theirs)


@pytest.mark.slow  # a swarm of its own
def test_a_float16_chain_of_torch_and_onnx_equals_hugging_face_in_float16(tiny_models):
    """``--dtype float16`` on both runtimes (ONNX Runtime's CPU provider runs the graph in float16) and a float16
    client: logits within float16's bound of Hugging Face's in float16, the same greedy tokens."""
    from swarm.families.selfcheck import TOLERANCES

    folder, half = tiny_models["llama"], torch.float16
    with running_swarm(str(folder), ["0:2"], "--dtype", "float16") as swarm:
        swarm.add_peer("2:4", "--runtime", "onnx")
        with connect(str(folder), swarm, dtype=half) as client:
            ref = local_reference(folder).to(half)
            ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                ours, theirs = client(ids).logits.float(), ref(ids).logits.float()
            assert [(h.runtime, h.dtype) for h in client.route] == [("torch", "float16"), ("onnx", "float16")]
            assert (ours - theirs).abs().max().item() <= TOLERANCES[half] * max(1.0, theirs.abs().max().item())
            out = client.generate(ids[:1], max_new_tokens=12, do_sample=False)
            assert torch.equal(out, ref.generate(ids[:1], max_new_tokens=12, do_sample=False))
