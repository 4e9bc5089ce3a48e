"""Adapter pieces without a swarm: tensor names, target resolution, server-side validation and cache, the client's
content version and gradient assembly."""

from __future__ import annotations

import pytest
import torch

from peers.serving.adapters import AdapterCache, parse_adapter
from swarm.client.tuning.adapters import ClientAdapters
from swarm.errors import AdapterMissingError, BadInputError
from swarm.ids import Span
from swarm.protocol import AdapterRef
from swarm.tuning import TuningSpec, parse_name, resolve_targets

LINEARS = {"self_attn.q_proj": (8, 8), "self_attn.v_proj": (8, 4), "mlp.down_proj": (16, 8)}


def test_names_and_targets():
    assert parse_name("lora.3.self_attn.q_proj.A") == ("lora", 3, "self_attn.q_proj", "A")
    assert parse_name("deep.12") == ("deep", 12, None, None)
    for bad in ("lora.3.A", "lora.x.q.A", "deep.1.extra", "other.1.q.A", "lora.1.q.C"):
        with pytest.raises(BadInputError):
            parse_name(bad)
    assert resolve_targets(("q_proj", "mlp.down_proj"), LINEARS) == ("self_attn.q_proj", "mlp.down_proj")
    with pytest.raises(BadInputError, match="unsupported LoRA target 'gate'"):
        resolve_targets(("gate",), LINEARS)
    with pytest.raises(BadInputError):
        TuningSpec("lora", lora_rank=0)
    with pytest.raises(BadInputError):
        TuningSpec("prompt", num_prompt_tokens=0)


def _pair(block=0, path="self_attn.q_proj", rank=2, fan_in=8, fan_out=8):
    return {f"lora.{block}.{path}.A": torch.zeros(rank, fan_in), f"lora.{block}.{path}.B": torch.zeros(fan_out, rank)}


def test_parse_adapter_checks_everything():
    sub = Span(0, 2)
    ok = parse_adapter(dict(_pair(), **_pair(1, "self_attn.v_proj", fan_out=4)), sub, LINEARS, 8, torch.float32, 2.0)
    assert set(ok.lora) == {(0, "self_attn.q_proj"), (1, "self_attn.v_proj")} and ok.scaling == 2.0
    cases = {
        "outside the requested blocks": _pair(block=2),
        "no linear module": _pair(path="self_attn.k_proj"),
        "must be A": _pair(fan_in=7),
        "lacks its B": {"lora.0.self_attn.q_proj.A": torch.zeros(2, 8)},
        "must be torch.float32": {k: v.double() for k, v in _pair().items()},
        "deep prompt": {"deep.0": torch.zeros(2, 9)},
        "differ in length": {"deep.0": torch.zeros(2, 8), "deep.1": torch.zeros(3, 8)},
    }
    for message, tensors in cases.items():
        with pytest.raises(BadInputError, match=message):
            parse_adapter(tensors, sub, LINEARS, 8, torch.float32, 1.0)


def test_cache_by_client_version_blocks_bytes_and_age():
    now = [0.0]
    cache = AdapterCache(max_bytes=1000, ttl=10.0, clock=lambda: now[0])
    ref = AdapterRef(client="a" * 64, version=1, has_tensors=True)
    adapter = parse_adapter(dict(_pair(0), **_pair(1)), Span(0, 2), LINEARS, 8, torch.float32, 1.0)

    def put(r, sub, caller="me"):
        cache.put(caller, r, adapter, sub)[1].release()

    def get(r, sub, caller="me"):
        got, pin = cache.get(caller, r, sub)
        pin.release()
        return got

    put(ref, Span(0, 2))
    assert set(get(ref, Span(1, 2)).lora) == {(1, "self_attn.q_proj")}  # a sub-span of what was sent
    with pytest.raises(AdapterMissingError):
        get(ref, Span(0, 3))  # block 2 never sent
    with pytest.raises(AdapterMissingError):
        get(ref.model_copy(update={"version": 2}), Span(0, 2))
    with pytest.raises(AdapterMissingError):
        get(ref.model_copy(update={"client": "b" * 64}), Span(0, 2))
    with pytest.raises(AdapterMissingError):  # the same token from another caller (a server on the route) finds nothing
        get(ref, Span(0, 2), caller="eavesdropper")
    cache.drop("eavesdropper", ref.client)  # ...and cannot release it
    get(ref, Span(0, 2))
    put(ref.model_copy(update={"version": 2}), Span(1, 2))  # a new version drops the old blocks
    with pytest.raises(AdapterMissingError):
        get(ref.model_copy(update={"version": 2}), Span(0, 2))
    now[0] = 11.0
    with pytest.raises(AdapterMissingError):  # idle too long
        get(ref.model_copy(update={"version": 2}), Span(1, 2))
    # bytes: 2 x 64 B per pair, 256 B per client; the least recently used client goes first
    for client in "cdefghijk":
        put(AdapterRef(client=client * 64, version=1, has_tensors=True), Span(0, 2))
        assert cache.nbytes <= 1000
    assert len(cache) < 9
    with pytest.raises(AdapterMissingError):
        get(AdapterRef(client="c" * 64, version=1, has_tensors=False), Span(0, 2))


def test_client_version_moves_with_optimizer_steps_and_gradients_assemble():
    spec = TuningSpec("lora", lora_rank=2, lora_targets=("q_proj", "v_proj"))
    adapters = ClientAdapters(spec, {k: LINEARS[k] for k in ("self_attn.q_proj", "self_attn.v_proj")}, 3, 8)
    assert all(not pair.B.detach().any() for layer in adapters.lora for pair in layer.values())  # as PEFT
    v = adapters.version()
    assert adapters.version() == v  # unchanged: same version
    opt = torch.optim.SGD(adapters.parameters(), lr=0.1)
    for p in adapters.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert adapters.version() == v + 1
    assert set(adapters.payload(1, 2, torch.float16)) == {
        "lora.1.self_attn.q_proj.A",
        "lora.1.self_attn.q_proj.B",
        "lora.1.self_attn.v_proj.A",
        "lora.1.self_attn.v_proj.B",
    }
    replies = [
        {"grad.lora.1.self_attn.q_proj.A": torch.ones(2, 8), "grad_input": torch.zeros(1)},
        {"grad.lora.1.self_attn.q_proj.A": torch.ones(2, 8)},  # the same block computed twice (a failover)
    ]
    grads = adapters.gradients(replies)
    params = adapters.remote_parameters()
    assert len(grads) == len(params) == 3 * 2 * 2
    index = next(i for i, p in enumerate(params) if p is adapters.lora[1]["self_attn__q_proj"].A)
    assert torch.equal(grads[index], torch.full((2, 8), 2.0))
    assert sum(g is not None for g in grads) == 1

    deep = ClientAdapters(TuningSpec("deep_prompt", num_prompt_tokens=2), {}, 3, 8)
    assert set(deep.payload(0, 3, torch.float32)) == {"deep.0", "deep.1", "deep.2"}
    (grad,) = deep.gradients([{"grad.deep.2": torch.ones(2, 8)}])
    assert grad.shape == (3, 2, 8) and float(grad[2].sum()) == 16 and not grad[:2].any()
    prompt = ClientAdapters(TuningSpec("prompt", num_prompt_tokens=4), {}, 3, 8)
    assert not prompt.applies_remotely and prompt.payload(0, 3, torch.float32) == {}
