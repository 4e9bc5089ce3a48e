"""Fine-tuning through the swarm (client-owned LoRA, prompts, deep prompts) equals the same adapter on a local
Hugging Face + PEFT model: gradients, loss curves and generation, on real servers over loopback."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm.errors import BadInputError
from tests.helpers.finetune import batch, close, lora_pairs, randomize
from tests.helpers.models import local_reference, make_tiny_model
from tests.helpers.swarms import connect, running_swarm

TARGETS = ("q_proj", "v_proj", "down_proj")  # attention and MLP modules


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def swarm(folder):
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        yield swarm


def peft_reference(folder, adapter_folder):
    import json

    from peft import PeftModel

    prompt = json.loads((adapter_folder / "adapter_config.json").read_text())["peft_type"] == "PROMPT_TUNING"
    # PEFT refuses is_trainable for saved prompt adapters; their prompt embedding is made trainable by hand
    model = PeftModel.from_pretrained(local_reference(folder), str(adapter_folder), is_trainable=not prompt)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or "prompt_encoder" in name)
    return model


def info(client, hop):
    """A server's live stats (its own account of cached adapters)."""
    conn = client.connection
    return conn.loop.run(conn.remote.info(hop, 5.0))


def test_lora_gradients_match_peft(folder, swarm, tmp_path):
    with connect(folder, swarm, tuning="lora", lora_rank=4, lora_alpha=8, lora_targets=TARGETS) as client:
        assert not any(p.requires_grad for n, p in client.named_parameters() if not n.startswith("adapters."))
        randomize(client)
        client.save_adapter(tmp_path)
        ref = peft_reference(folder, tmp_path)
        ids, mask, labels = batch()
        ours = client(input_ids=ids, attention_mask=mask, labels=labels)
        ours.loss.backward()
        theirs = ref(input_ids=ids, attention_mask=mask, labels=labels)
        theirs.loss.backward()
        assert close(ours.logits, theirs.logits, 1e-4)
        assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5
        pairs = lora_pairs(client, ref)
        assert len(pairs) == 4 * 3 * 2
        for mine, peft_param in pairs:
            assert mine.grad is not None and mine.grad.abs().sum() > 0
            assert close(mine.grad, peft_param.grad)
        assert client.traffic["adapter_bytes_sent"] > 0


def test_prompt_tuning_matches_peft(folder, swarm, tmp_path):
    with connect(folder, swarm, tuning="prompt", num_prompt_tokens=3) as client:
        client.save_adapter(tmp_path)
        ref = peft_reference(folder, tmp_path)
        ids, mask, labels = batch(6)
        ours = client(input_ids=ids, attention_mask=mask, labels=labels)
        ours.loss.backward()
        theirs = ref(input_ids=ids, attention_mask=mask, labels=labels)
        theirs.loss.backward()
        assert ours.logits.shape == (3, 12, 320)
        assert close(ours.logits, theirs.logits[:, 3:], 1e-4)
        assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5
        peft_prompts = ref.prompt_encoder["default"].embedding.weight
        assert close(client.adapters.prompts.grad, peft_prompts.grad)
        assert client.traffic.get("adapter_bytes_sent", 0) == 0  # input prompts never leave the client


def deep_prompt_reference(folder, prompts, deep, ids, mask, labels):
    """The same math locally: prompts prepended to the input; before each block, the block's own prompt added to
    the prompt positions."""
    ref = local_reference(folder)
    n = prompts.shape[0]
    hooks = []
    for i, layer in enumerate(ref.model.layers):

        def pre(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = torch.cat([hidden[:, :n] + deep[i], hidden[:, n:]], dim=1)
            return ((hidden, *args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=hidden))

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    embeds = torch.cat([prompts.expand(ids.shape[0], -1, -1), ref.model.embed_tokens(ids)], dim=1)
    full_mask = torch.cat([torch.ones(ids.shape[0], n, dtype=mask.dtype), mask], dim=1)
    full_labels = torch.cat([torch.full((ids.shape[0], n), -100), labels], dim=1)
    out = ref(inputs_embeds=embeds, attention_mask=full_mask, labels=full_labels)
    for h in hooks:
        h.remove()
    return out


def test_deep_prompts_match_local_math(folder, swarm):
    with connect(folder, swarm, tuning="deep_prompt", num_prompt_tokens=2) as client:
        randomize(client, 3)
        ids, mask, labels = batch(7)
        ours = client(input_ids=ids, attention_mask=mask, labels=labels)
        ours.loss.backward()
        prompts = client.adapters.prompts.detach().clone().requires_grad_()
        deep = client.adapters.deep.detach().clone().requires_grad_()
        theirs = deep_prompt_reference(folder, prompts, deep, ids, mask, labels)
        theirs.loss.backward()
        assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5
        assert close(ours.logits, theirs.logits[:, 2:], 1e-4)
        assert close(client.adapters.prompts.grad, prompts.grad)
        assert close(client.adapters.deep.grad, deep.grad)
        assert client.adapters.deep.grad.abs().sum() > 0
        # generation with deep prompts: the prompt positions get each block's prompt once, at prefill
        out = client.generate(ids[:1], max_new_tokens=5, do_sample=False)
        with torch.no_grad():
            expect = ids[:1]
            for _ in range(5):
                logits = deep_prompt_reference(folder, prompts, deep, expect, torch.ones_like(expect), expect).logits
                expect = torch.cat([expect, logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(out, expect)


@pytest.mark.slow  # three clients and two generations
def test_generate_uses_the_adapter_and_round_trips_through_peft_format(folder, swarm, tmp_path):
    ids = batch(8)[0][:1]
    with connect(folder, swarm, tuning="lora", lora_rank=2, lora_targets=("o_proj", "up_proj")) as client:
        randomize(client, 4)
        ours = client.generate(ids, max_new_tokens=12, do_sample=False)
        client.save_adapter(tmp_path)
    ref = peft_reference(folder, tmp_path)
    base = local_reference(folder).generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, ref.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0))
    assert not torch.equal(ours, base)  # the adapter really was applied
    with connect(folder, swarm, adapter=tmp_path) as again:  # the saved adapter loads back, tuning from its config
        assert again.adapters.spec.mode == "lora" and again.adapters.spec.lora_rank == 2
        assert torch.equal(again.generate(ids, max_new_tokens=12, do_sample=False), ours)


def train(model, steps: int, lr: float = 0.02) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step in range(steps):
        ids, mask, labels = batch(100 + step % 2)  # two batches in turn: the loss must fall
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_finetune_loss_curve_matches_local_peft(folder, swarm, tmp_path):
    with connect(folder, swarm, tuning="lora", lora_rank=4, lora_targets=TARGETS) as client:
        torch.manual_seed(0)
        client.save_adapter(tmp_path / "init")
        ref = peft_reference(folder, tmp_path / "init")
        uploads_before = client.traffic.get("adapter_bytes_sent", 0)
        ours = train(client, 8)
        theirs = train(ref, 8)
        sent = client.traffic["adapter_bytes_sent"] - uploads_before
        one_copy = sum(p.numel() * 4 for p in client.adapters.parameters())
        route = client.route
        held = [info(client, hop) for hop in route]
        assert all(i.adapter_clients == 1 and i.adapter_bytes > 0 for i in held), held
    # closing the client told the servers to drop its adapter at once (not only after the idle timeout)
    with connect(folder, swarm) as plain:
        held = [info(plain, hop) for hop in route]
    assert all(i.adapter_clients == 0 for i in held), held
    assert ours[-1] < ours[0]  # it learns
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b))
    # one upload per optimizer step (at the step's forward), none at the backward
    assert sent == 8 * one_copy


@pytest.mark.slow  # two clients at once, then their local replays
def test_two_clients_train_different_adapters_at_once(folder, swarm, tmp_path):
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with connect(folder, swarm, tuning="lora", lora_rank=2 + k, lora_targets=TARGETS) as client:
                randomize(client, 10 + k)
                client.save_adapter(tmp_path / f"c{k}")
                grads = []
                for step in range(4):
                    ids, mask, labels = batch(200 + 10 * k + step)
                    client(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
                    grads.append([p.grad.clone() for p in client.adapters.parameters()])
                    with torch.no_grad():
                        for p in client.adapters.parameters():
                            p -= 0.05 * p.grad  # a plain SGD step, so each version differs
                            p.grad = None
                results[k] = grads
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):  # each client's gradients equal its own adapter's, computed alone and locally
        ref = peft_reference(folder, tmp_path / f"c{k}")
        params = [theirs for _, theirs in lora_pairs_by_order(ref, 2 + k)]
        for step in range(4):
            ids, mask, labels = batch(200 + 10 * k + step)
            ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            for mine, theirs in zip(results[k][step], params, strict=True):
                assert close(mine, theirs.grad)
            with torch.no_grad():
                for p in params:
                    p -= 0.05 * p.grad
                    p.grad = None


def lora_pairs_by_order(peft_model, rank: int):
    named = dict(peft_model.named_parameters())
    for block in range(4):
        for path in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            for which in ("A", "B"):
                param = named[f"base_model.model.model.layers.{block}.{path}.lora_{which}.default.weight"]
                assert rank in param.shape
                yield None, param


@pytest.mark.slow  # four clients, and a model and two PEFT adapters saved
def test_bad_adapters_are_refused_before_training(folder, swarm, tmp_path):
    with pytest.raises(BadInputError, match="unsupported LoRA target 'qkv'"):
        connect(folder, swarm, tuning="lora", lora_targets=("qkv",))
    with pytest.raises(BadInputError, match="tuning must be one of"):
        connect(folder, swarm, tuning="prefix")
    # a PEFT adapter made for another model (other hidden size) does not fit
    from peft import LoraConfig, get_peft_model

    other = make_tiny_model(tmp_path / "other", "llama", hidden_size=32, num_attention_heads=2)
    peft_model = get_peft_model(local_reference(other), LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(BadInputError, match="has shape"):
        connect(folder, swarm, adapter=tmp_path / "adapter")
    # ...and one from a PEFT model of the same shape loads, and computes as PEFT does
    same = get_peft_model(local_reference(folder), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    same.save_pretrained(tmp_path / "same")
    ids = batch(9)[0]
    with connect(folder, swarm, adapter=tmp_path / "same") as client, torch.no_grad():
        assert close(client(ids).logits, same(input_ids=ids).logits, 1e-4)


@pytest.mark.slow
def test_finetuning_survives_servers_dying_mid_step(folder, tmp_path):
    """One server dies between a step's forward and its backward, another before a step's forward: the client
    re-routes (sending its adapter to the replacements) and the loss curve and gradients stay those of local PEFT.
    One replica of each span announces half the speed, so routes go to the other while it lives: each kill hits a
    server the next call is routed to."""
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        for span in ("0:2", "2:4"):
            swarm.add_peer(span, "--throughput", "50")
        with connect(folder, swarm, tuning="lora", lora_rank=4, lora_targets=TARGETS) as client:
            randomize(client, 21)
            client.save_adapter(tmp_path)
            ref = peft_reference(folder, tmp_path)
            ours_opt = torch.optim.AdamW([p for p in client.parameters() if p.requires_grad], lr=0.02)
            ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.02)
            killed = []
            for step in range(3):
                ids, mask, labels = batch(300 + step)
                failovers = client.failovers
                if step == 2:  # before the forward: the second span's server is gone
                    killed.append(client.route[1].peer_id)
                    swarm.kill(swarm.peer_by_id(killed[-1]))
                loss = client(input_ids=ids, attention_mask=mask, labels=labels).loss
                if step == 1:  # between forward and backward: the first span's server is gone
                    killed.append(client.route[0].peer_id)
                    swarm.kill(swarm.peer_by_id(killed[-1]))
                loss.backward()
                if step > 0:  # the kill was met: the client failed over from the very server killed
                    assert client.failovers > failovers and killed[-1] in client.connection.retrier.failures
                ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
                ref_loss.backward()
                assert abs(loss.item() - ref_loss.item()) < 1e-4
                for mine, theirs in lora_pairs(client, ref):
                    assert close(mine.grad, theirs.grad, 1e-4)
                for opt in (ours_opt, ref_opt):
                    opt.step()
                    opt.zero_grad()
            assert len(set(killed)) == 2 and not {h.peer_id for h in client.route} & set(killed)
