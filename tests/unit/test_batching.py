"""Continuous batching inside a server's runtime: several sessions' steps run as one forward give what each gives
alone (every family, sessions at different positions, padded rows, LoRA rows beside plain ones, sliding windows
filled), and their caches end up as if each had stepped alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from peers.blocks.backend import SpanBackend
from peers.blocks.batched import batchable
from peers.serving.adapters import Adapter
from peers.serving.kv_cache import rewind
from peers.serving.runtime import Row
from swarm.families.spec import family_of
from swarm.ids import Span
from tests.helpers.families import FAMILIES, tiny_config

EXACT = 1e-5  # relative to the outputs' scale where it exceeds 1: GPT-2's hidden states reach ~10, where float32's
# rounding alone (a batched matmul blocks its sums otherwise) is ~1e-6 of it; measured 1.1e-5 absolute on an AMD EPYC


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() < EXACT * max(1.0, b.abs().max().item())


def _backend(name: str) -> SpanBackend:
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    family = family_of(ref.config)
    layers = getattr(getattr(ref, family.base_prefix), family.layers_attr)
    span = Span(0, family.num_layers)
    return SpanBackend(family.config, family, torch.nn.ModuleList(list(layers)), span, "cpu", torch.float32)


def _lora(backend: SpanBackend) -> Adapter:
    g = torch.Generator().manual_seed(1)
    lora = {}
    for block in range(backend.span.start, backend.span.end):
        for path, (fan_in, fan_out) in backend.linears.items():
            a, b = torch.randn(4, fan_in, generator=g), torch.randn(fan_out, 4, generator=g)
            lora[(block, path)] = (a * 0.2, b * 0.2)
    return Adapter(2.0, lora)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_batch_of_sessions_equals_each_alone(name):
    backend = _backend(name)
    span, hidden_size = backend.span, int(backend.config.hidden_size)
    adapter = _lora(backend) if backend.linears else None
    g = torch.Generator().manual_seed(2)
    # four sessions: different prompt lengths (past every sliding window of 8 for two), one of two padded sequences,
    # one with a LoRA adapter
    prompts = [3, 11, 6, 14]
    widths = [1, 1, 2, 1]
    adapters = [None, adapter, None, None]
    masks: list[torch.Tensor | None] = [None, None, torch.ones(2, 64, dtype=torch.long), None]
    masks[2][1, :2] = 0  # type: ignore[index]  # the second sequence of session 2 is left-padded by 2
    caches = [backend.new_cache() for _ in prompts]
    with torch.inference_mode():
        for cache, length, width, mask, adapt in zip(caches, prompts, widths, masks, adapters, strict=True):
            h = torch.randn(width, length, hidden_size, generator=g)
            m = mask[:, :length] if mask is not None else None
            backend.run(h, span, attention_mask=m, cache=cache, adapter=adapt)
        assert all(batchable(c) for c in caches)
        alone = [copy.deepcopy(c) for c in caches]
        positions = list(prompts)
        for _ in range(3):  # three decode steps of all four sessions, batched and alone
            inputs = [torch.randn(w, 1, hidden_size, generator=g) for w in widths]
            for c in (*caches, *alone):
                rewind(c, 0)
            rows = [
                Row(h, c, p, m[:, : p + 1] if m is not None else None, None, a)
                for h, c, p, m, a in zip(inputs, caches, positions, masks, adapters, strict=True)
            ]
            together = backend.run_batch(rows, span)
            for h, c, p, m, a, got in zip(inputs, alone, positions, masks, adapters, together, strict=True):
                mm = m[:, : p + 1] if m is not None else None
                want = backend.run(h, span, attention_mask=mm, cache=c, past=p, adapter=a)
                assert got.shape == want.shape
                assert _close(got, want)
            positions = [p + 1 for p in positions]
    for batched_cache, own in zip(caches, alone, strict=True):
        for a, b in zip(batched_cache.layers, own.layers, strict=True):
            if b.is_initialized:
                assert a.keys.shape == b.keys.shape
                assert _close(a.keys, b.keys)


def test_lora_rows_differ_from_plain_rows_in_one_batch():
    """The per-row adapter hook applies each row's own delta: the same input with and without LoRA in one batch
    gives two different outputs, each equal to its own run alone."""
    backend = _backend("llama")
    span, hidden = backend.span, int(backend.config.hidden_size)
    adapter = _lora(backend)
    x = torch.randn(1, 1, hidden)
    with torch.inference_mode():
        caches = [backend.new_cache(), backend.new_cache()]
        prompt = torch.randn(1, 5, hidden)
        for c, a in zip(caches, (None, adapter), strict=True):
            backend.run(prompt, span, cache=c, adapter=a)
        plain, tuned = backend.run_batch([Row(x, caches[0], 5), Row(x, caches[1], 5, adapter=adapter)], span)
    assert (plain - tuned).abs().max().item() > 1e-3


def test_a_batch_that_fails_half_way_leaves_every_cache_as_it_was():
    """Layers before the failure already appended the step to the rows' caches: the runtime takes it back, so the
    scheduler can run each row again alone."""
    backend = _backend("mistral")  # full and sliding layers
    span, hidden = backend.span, int(backend.config.hidden_size)
    with torch.inference_mode():
        caches = [backend.new_cache() for _ in range(3)]
        for c, length in zip(caches, (4, 12, 7), strict=True):
            backend.run(torch.randn(1, length, hidden), span, cache=c)
        for c in caches:
            rewind(c, 0)
        before = copy.deepcopy(caches)

        def fail(*_: object) -> None:
            raise RuntimeError("out of memory, say")

        handle = backend.layers[1].register_forward_pre_hook(fail)
        rows = [Row(torch.randn(1, 1, hidden), c, p) for c, p in zip(caches, (4, 12, 7), strict=True)]
        with pytest.raises(RuntimeError):
            backend.run_batch(rows, span)
        handle.remove()
    for c, b in zip(caches, before, strict=True):
        for got, want in zip(c.layers, b.layers, strict=True):
            if want.is_initialized:
                assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
