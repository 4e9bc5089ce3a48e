"""Quantized blocks in a real swarm (``--quantize int8|nf4``): one tiny model served exactly by two peers, in NF4 and
in int8 by one peer each, all announced ten times faster than the exact ones. A client that did not allow quantized
blocks never routes through them; one that allows a format gets the logits of a local Hugging Face model whose
blocks are quantized the same way, LoRA trains through them (QLoRA) with PEFT's gradients on that local model, and a
peer that holds NF4 blocks while announcing the exact weights' fingerprint is caught by verification."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peers.blocks.quantize import quantize_layer
from swarm.errors import MissingBlocksError
from swarm.families.selfcheck import TOLERANCES
from tests.helpers.finetune import batch, close, lora_pairs, randomize
from tests.helpers.models import local_reference
from tests.helpers.scripts import load_script
from tests.helpers.swarms import connect, patient_timing, running_swarm, wait_for

VOCAB = 320
FAST = ("--throughput", "1000")  # routing prefers these peers whenever a client may use them


@pytest.fixture(scope="module")
def swarm(tiny_models):
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:4", "0:4"]) as swarm:
        nf4 = swarm.add_peer("0:4", "--quantize", "nf4", *FAST, wait=False)
        int8 = swarm.add_peer("0:4", "--quantize", "int8", *FAST, wait=False)
        for peer in (nf4, int8):
            peer.wait_ready(swarm.startup_timeout)
        yield folder, swarm, {"nf4": nf4.peer_id, "int8": int8.peer_id}


def quantized_reference(folder: str, fmt: str):
    """The local Hugging Face model with its blocks' linear maps quantized as a ``--quantize fmt`` server holds them."""
    ref = local_reference(folder)
    for layer in ref.model.layers:
        assert quantize_layer(layer, fmt, torch.float32, torch.device("cpu")) > 0
    return ref


def _client(folder, swarm, servers: int, **kwargs):
    """A client, once its view holds ``servers`` servers (it sees only those of the weights it accepts)."""
    client = connect(folder, swarm, timing=patient_timing(), **kwargs)
    wait_for(lambda: len(client.connection.view.servers()) >= servers, 60, "every server in the client's view")
    return client


def _ids(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_records_name_the_format_and_exact_clients_never_route_through_it(swarm):
    folder, local, quantized = swarm
    with _client(folder, local, 4, allow_quantized=True) as client:
        records = {r.peer_id: r for r in client.connection.view.servers()}
        # announced by every peer, and hashed into fingerprints no exact peer shares
        assert {records[p].quantization for p in quantized.values()} == {"nf4", "int8"}
        exact = [r for p, r in records.items() if p not in quantized.values()]
        assert [r.quantization for r in exact] == ["none", "none"]
        assert len({r.fingerprint for r in records.values()}) == 3
    with _client(folder, local, 2) as client:
        # the client's view holds the exact peers only
        assert {r.peer_id for r in client.connection.view.servers()} == {r.peer_id for r in exact}
        # the quantized peers are ten times faster, and still never used
        for seed in range(3):
            client.generate(_ids(seed)[:1], max_new_tokens=4, do_sample=False)
            assert not {h.peer_id for h in client.route} & set(quantized.values())
            assert {h.quantization for h in client.route} == {"none"}
        # ...and the exact results are Hugging Face's
        ref = local_reference(folder)
        with torch.no_grad():
            assert (client(_ids(7)).logits - ref(_ids(7)).logits).abs().max().item() < 1e-4
    # a client allowing int8 only takes the int8 peer (faster than the exact ones), never the NF4 one
    with _client(folder, local, 3, allow_quantized=["int8"]) as client:
        client.generate(_ids(3)[:1], max_new_tokens=4, do_sample=False)
        assert [(h.peer_id, h.quantization) for h in client.route] == [(quantized["int8"], "int8")]


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_quantized_route_equals_hugging_face_quantized_the_same_way(swarm, fmt):
    folder, local, quantized = swarm
    ref = quantized_reference(folder, fmt)
    exact = local_reference(folder)
    with _client(folder, local, 3, allow_quantized=fmt) as client:
        ids = _ids(11)
        with torch.no_grad():
            ours = client(ids).logits
            theirs = ref(ids).logits
        assert [h.peer_id for h in client.route] == [quantized[fmt]]
        assert (ours - theirs).abs().max().item() < 1e-4
        with torch.no_grad():  # and it is a real quantization: unlike the exact model's logits
            assert (ours - exact(ids).logits).abs().max().item() > 1e-3
        out = client.generate(ids[:1], max_new_tokens=12, do_sample=False)
        assert torch.equal(out, ref.generate(ids[:1], max_new_tokens=12, do_sample=False))


@pytest.mark.slow  # the fast subset keeps the routing and the quantized routes' exactness
def test_qlora_through_nf4_servers_has_pefts_gradients_on_the_quantized_model(swarm, tmp_path):
    folder, local, quantized = swarm
    targets = ("q_proj", "v_proj", "down_proj")
    lora = dict(tuning="lora", lora_rank=4, lora_targets=targets)
    with _client(folder, local, 3, allow_quantized="nf4", **lora) as client:
        randomize(client)
        client.save_adapter(tmp_path)
        from peft import PeftModel

        # PEFT over the quantized local model (it wraps bitsandbytes' NF4 layers with its own QLoRA layers)
        ref = PeftModel.from_pretrained(quantized_reference(folder, "nf4"), str(tmp_path), is_trainable=True)
        ids, mask, labels = batch()
        ours = client(input_ids=ids, attention_mask=mask, labels=labels)
        ours.loss.backward()
        theirs = ref(input_ids=ids, attention_mask=mask, labels=labels)
        theirs.loss.backward()
        assert [h.peer_id for h in client.route] == [quantized["nf4"]]
        assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5
        pairs = lora_pairs(client, ref)
        assert len(pairs) == 4 * 3 * 2
        for mine, peft_param in pairs:
            assert mine.grad is not None and mine.grad.abs().sum() > 0
            assert close(mine.grad, peft_param.grad, 1e-4)
        # a few steps train: the loss falls, and nothing of the base moved (the servers keep answering exactly)
        opt = torch.optim.Adam([p for p in client.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = client(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.95  # 5.85 -> 5.38 here


@pytest.mark.slow  # the fast subset keeps the routing and the quantized routes' exactness
def test_quantized_only_blocks_are_missing_for_an_exact_client(tiny_models):
    """Blocks only a quantized peer serves are missing to a client that did not allow it: never silently routed."""
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:2"]) as swarm:
        swarm.add_peer("2:4", "--quantize", "nf4")
        # first a client that allows it finds the NF4 peer's record, so the exact client below sees the same swarm
        with connect(folder, swarm, timing=patient_timing(), allow_quantized=True) as client:
            client.generate(_ids(1)[:1], max_new_tokens=2, do_sample=False)
            assert [h.quantization for h in client.route] == ["none", "nf4"]
        # the exact client waits a few seconds for exact blocks 2:4 (not the patient minute), then fails: only 2:4
        timing = dataclasses.replace(patient_timing(), missing_blocks_wait=4.0)
        with connect(folder, swarm, timing=timing) as client:
            with pytest.raises(MissingBlocksError) as missing:
                client.generate(_ids(1)[:1], max_new_tokens=2, do_sample=False)
            assert missing.value.blocks == [2, 3]  # blocks 0:2 were found: the swarm was seen, the NF4 span refused


@pytest.mark.slow  # a cheater per format
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantized_blocks_passed_off_as_exact_are_caught(swarm, fmt):
    """A cheater holding the library's NF4 or int8 blocks while announcing the exact fingerprint (ten times faster:
    routed to first) is caught by verification, banned and left."""
    folder, local, _ = swarm
    cheater = load_script("cheating_server").start_cheater(local, fmt, "0:4").peer_id
    ref = local_reference(folder)
    with _client(folder, local, 3, verify_every=4, verify_seed=1, accuse=False) as client:
        with client.inference_session(max_length=64) as session:
            client.generate(_ids(5)[:1], max_new_tokens=24, do_sample=False)
        assert cheater in session.caught
        assert cheater in client.connection.view.banned()
        ids = _ids(6)[:1]  # and the client's next answer is the exact weights' again
        out = client.generate(ids, max_new_tokens=8, do_sample=False)
        assert cheater not in [h.peer_id for h in client.route]
        assert torch.equal(out, ref.generate(ids, max_new_tokens=8, do_sample=False))
    local.kill(local.peer_by_id(cheater))


@pytest.mark.slow  # the fast subset keeps the routing and the quantized routes' exactness
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_spans_exact_and_nf4_equal_hugging_face_in_that_dtype(tiny_models, dtype):
    """Servers of ``--dtype bfloat16|float16`` (one exact, one NF4 computing in that dtype) and clients of the same
    dtype: logits within the self-check's bound for the dtype (``swarm.families.selfcheck.TOLERANCES``) of a local
    Hugging Face model in that dtype (quantized the same way for the NF4 route), greedy tokens identical."""
    folder = str(tiny_models["llama"])
    name = str(dtype).removeprefix("torch.")
    ids = _ids(13, 17)
    with running_swarm(folder, ["0:4"], "--dtype", name) as local:
        local.add_peer("0:4", "--quantize", "nf4", *FAST)
        for allow, fmt in ((False, "none"), ("nf4", "nf4")):
            ref = local_reference(folder).to(dtype)
            if fmt != "none":  # quantized from the weights in this dtype, as the server did
                for layer in ref.model.layers:
                    quantize_layer(layer, fmt, dtype, torch.device("cpu"))
            with _client(folder, local, 2 if allow else 1, dtype=dtype, allow_quantized=allow) as client:
                with torch.no_grad():
                    ours, theirs = client(ids).logits, ref(ids).logits
                assert ours.dtype == dtype and [(h.dtype, h.quantization) for h in client.route] == [(name, fmt)]
                bound = TOLERANCES[dtype] * max(1.0, theirs.abs().max().item())
                assert (ours.float() - theirs.float()).abs().max().item() <= bound
                out = client.generate(ids[:1], max_new_tokens=12, do_sample=False)
                assert torch.equal(out, ref.generate(ids[:1], max_new_tokens=12, do_sample=False))
