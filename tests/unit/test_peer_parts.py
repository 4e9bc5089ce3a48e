"""Server-side pure parts: KV-cache budget, kept activations, selective loading, family key conversion."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.serving.activations import ActivationStore, Kept
from peers.serving.kv_cache import CacheBudget
from swarm import model_files
from swarm.errors import CacheFullError
from swarm.ids import Span
from tests.helpers.models import make_tiny_model


async def test_cache_budget_waits_then_refuses():
    budget = CacheBudget(100)
    await budget.reserve(60, timeout=0.1)
    with pytest.raises(CacheFullError, match="no KV-cache room"):
        await budget.reserve(50, timeout=0.05)
    with pytest.raises(CacheFullError, match="whole budget"):
        await budget.reserve(101, timeout=0.05)
    waiter = asyncio.create_task(budget.reserve(50, timeout=60.0))  # a bound on a hang only
    for _ in range(5):  # the loop runs the waiter into its wait: no timer, nothing to depend on the machine's speed
        await asyncio.sleep(0)
    assert not waiter.done()  # no room yet: it waits
    await budget.release(60)
    assert await waiter == 50 and budget.free == 50


def test_activation_store_expires_and_bounds():
    now = [0.0]
    store = ActivationStore(max_bytes=100, max_bytes_per_caller=100, ttl=10.0, clock=lambda: now[0])
    t = torch.zeros(1)
    for key in "abc":
        assert store.put("me", key, Kept(t, t, Span(0, 1), nbytes=40))
    assert store.pop("me", "a") is None and len(store) == 2 and store.nbytes == 80
    now[0] = 11.0
    assert store.pop("me", "b") is None and store.pop("me", "c") is None and store.nbytes == 0


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("mixtral", {"num_local_experts": 3})])
def test_load_span_reads_only_its_blocks(tmp_path, monkeypatch, model_type, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "m", model_type, **extra)
    config = AutoConfig.from_pretrained(folder)
    read = []
    original = model_files.read_tensors
    monkeypatch.setattr("swarm.model_files.read_tensors", lambda f, names: read.extend(names) or original(f, names))
    layers = load_span(folder, family_for(config), Span(1, 3), torch.float32, "cpu")
    assert read and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for ours, theirs in zip(layers, full.model.layers[1:3], strict=True):
        theirs_state = theirs.state_dict()
        for name, tensor in ours.state_dict().items():
            assert torch.equal(tensor, theirs_state[name]), name


def test_a_server_s_own_failure_reaches_the_caller_without_its_text():
    """``peers.rpc.edge.error_reply``: an internal exception's message (a path, a value, an address) stays in the
    server's log; the caller gets its kind and an incident id to report. A refusal of the caller's request keeps its
    reason, which is about what the caller sent."""
    from peers.rpc.edge import error_reply
    from swarm import wire
    from swarm.errors import BadInputError

    (frame,) = error_reply(RuntimeError("secret /home/volunteer/.cache/weights at 0x7f00deadbeef"))
    meta, _ = wire.decode([frame], 1 << 16)
    assert meta["code"] == "swarm_error" and "RuntimeError" in meta["error"] and "incident" in meta["error"]
    assert "secret" not in meta["error"] and "/home" not in meta["error"] and "0x7f" not in meta["error"]
    (frame,) = error_reply(BadInputError("hidden states of 3 positions, the request said 4"))
    meta, _ = wire.decode([frame], 1 << 16)
    assert meta["error"] == "hidden states of 3 positions, the request said 4"
