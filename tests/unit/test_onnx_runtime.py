"""The ONNX runtime against the torch runtime on the same weights: prefill of a padded batch, decode steps with a KV
cache, sub-spans and sessions entered mid-span, for each Llama-family model it serves; what it refuses; exports
written once and reused."""

from __future__ import annotations

import pytest
import torch

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.blocks.onnx_export import block_path, check_exportable, export_span
from peers.blocks.onnx_runtime import OnnxSpan
from peers.blocks.serving_stage import ServingStage
from peers.config import PeerConfig
from peers.serving.adapters import Adapter
from peers.serving.config import ComputeConfig
from peers.serving.runtime import SpanRuntime
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.model_files import load_config
from swarm.records import ALL_CAPABILITIES, Capability

# The stated tolerance: the largest absolute difference between the two runtimes' hidden states (float32). Measured
# on the tiny models: 2.4e-7 (the two compute the same math in a different order of float32 roundings).
TOLERANCE = 1e-5
SPAN = Span(0, 4)


def runtimes(folder, exports) -> tuple[SpanBackend, OnnxSpan]:
    family = family_for(load_config(folder))
    config = family.config
    layers = load_span(folder, family, SPAN, torch.float32, "cpu")
    graphs = export_span(exports, config, SPAN, lambda s: load_span(folder, family, s, torch.float32, "cpu"))
    return SpanBackend(config, family, layers, SPAN, "cpu", torch.float32), OnnxSpan(config, family, SPAN, graphs, 1)


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    """A family's torch and ONNX runtimes of blocks 0:4, exported and loaded once for the module's tests (each test
    opens caches of its own; the runtimes hold none)."""
    made: dict[str, tuple[SpanBackend, OnnxSpan]] = {}

    def get(family: str) -> tuple[SpanBackend, OnnxSpan]:
        if family not in made:
            made[family] = runtimes(tiny_models[family], tmp_path_factory.mktemp(f"onnx-{family}"))
        return made[family]

    return get


def close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    assert a.shape == b.shape and torch.isfinite(b).all()
    diff = (a - b).abs() if mask is None else (a - b)[mask.bool()].abs()
    return diff.max().item() < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])  # mistral: sliding window 16; qwen2: biases
def test_onnx_span_equals_torch_span(exported, family):
    torch_rt, onnx_rt = exported(family)
    assert onnx_rt.capabilities == {Capability.INFERENCE, Capability.FORWARD} and onnx_rt.name == "onnx"
    assert torch_rt.capabilities == ALL_CAPABILITIES and torch_rt.name == "torch"
    rts: tuple[SpanRuntime, SpanRuntime] = (torch_rt, onnx_rt)  # both are the servers' interface
    gen = torch.Generator().manual_seed(0)
    batch, n = 2, 21  # longer than mistral's window, so the window cuts
    x = torch.randn(batch, n, 64, generator=gen)
    mask = torch.ones(batch, n, dtype=torch.int64)
    mask[1, :5] = 0  # a left-padded row, as clients send padded batches
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        # a forward pass (no cache), then a sub-span entered mid-span
        a, b = (rt.run(x, SPAN, attention_mask=mask, position_ids=pos) for rt in rts)
        assert close(a, b)  # padded positions too: both mask a fully padded row to finite values
        a, b = (rt.run(x, Span(1, 3), attention_mask=mask, position_ids=pos) for rt in rts)
        assert close(a, b)
        # a session: prefill, then 8 single-token steps on the cache
        sessions = [(rt, rt.new_cache()) for rt in rts]
        a, b = (rt.run(x, SPAN, attention_mask=mask, position_ids=pos, cache=c) for rt, c in sessions)
        assert close(a, b, mask[..., None].expand_as(a))
        for step in range(8):
            y = torch.randn(batch, 1, 64, generator=gen)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.int64)], dim=1)
            p = pos[:, -1:] + 1 + step
            a, b = (rt.run(y, SPAN, attention_mask=mask, position_ids=p, cache=c, past=n + step) for rt, c in sessions)
            assert close(a, b), step
        # a session on a sub-span (a client entering the server mid-span), without mask or positions
        sessions = [(rt, rt.new_cache()) for rt in rts]
        a, b = (rt.run(x, Span(2, 4), cache=c) for rt, c in sessions)
        assert close(a, b)
        a, b = (rt.run(x[:, :3], Span(2, 4), cache=c, past=n) for rt, c in sessions)
        assert close(a, b)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_float16_onnx_span_equals_the_float16_torch_span(tiny_models, tmp_path, family):
    """Graphs written in float16 (weights, tables, masks, caches; norm statistics in float32) on ONNX Runtime's CPU
    provider against torch's float16 span, within float16's bound (``selfcheck.TOLERANCES``): measured 1e-3."""
    from swarm.families.selfcheck import TOLERANCES

    folder, half = tiny_models[family], torch.float16
    fam = family_for(load_config(folder), half)
    layers = load_span(folder, fam, SPAN, half, "cpu")
    graphs = export_span(tmp_path, fam.config, SPAN, lambda s: load_span(folder, fam, s, half, "cpu"), half)
    rts = (SpanBackend(fam.config, fam, layers, SPAN, "cpu", half), OnnxSpan(fam.config, fam, SPAN, graphs, 1, half))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 21, 64, generator=gen).to(half)
    mask = torch.ones(2, 21, dtype=torch.int64)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def near(a: torch.Tensor, b: torch.Tensor) -> bool:
        assert a.dtype == b.dtype == half and torch.isfinite(b).all()
        return (a.float() - b.float()).abs().max().item() <= TOLERANCES[half] * max(1.0, b.float().abs().max().item())

    with torch.inference_mode():
        sessions = [(rt, rt.new_cache()) for rt in rts]
        a, b = (rt.run(x, SPAN, attention_mask=mask, position_ids=pos, cache=c) for rt, c in sessions)
        assert near(a[0], b[0]) and near(a[1, 5:], b[1, 5:])
        for step in range(6):
            y = torch.randn(2, 1, 64, generator=gen).to(half)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
            p = pos[:, -1:] + 1 + step
            a, b = (rt.run(y, SPAN, attention_mask=mask, position_ids=p, cache=c, past=21 + step) for rt, c in sessions)
            assert near(a, b), step


def test_a_step_retried_after_a_failure_recomputes_from_the_sessions_position(exported):
    """A step that failed on a later block left earlier blocks' caches a step ahead; the server's position is the
    truth, so the retried step gives the same output as a clean one."""
    _, onnx_rt = exported("llama")
    x = torch.randn(1, 5, 64)
    clean, retried = onnx_rt.new_cache(), onnx_rt.new_cache()
    onnx_rt.run(x, SPAN, cache=clean)
    onnx_rt.run(x, SPAN, cache=retried)
    step = torch.randn(1, 1, 64)
    onnx_rt.run(step, Span(0, 2), cache=retried, past=5)  # blocks 0:2 grew, then "the step failed"
    assert torch.equal(onnx_rt.run(step, SPAN, cache=clean, past=5), onnx_rt.run(step, SPAN, cache=retried, past=5))


def test_onnx_runtime_refuses_what_it_cannot_do(exported):
    _, onnx_rt = exported("llama")
    x = torch.randn(1, 3, 64)
    with pytest.raises(BadInputError, match="'adapters' capability, which this server's onnx runtime lacks"):
        onnx_rt.run(x, SPAN, adapter=Adapter())
    with pytest.raises(BadInputError, match="'backward' capability"):
        onnx_rt.run(x.requires_grad_(), SPAN)
    with pytest.raises(TypeError, match="takes an OnnxCache"):
        onnx_rt.run(torch.randn(1, 3, 64), SPAN, cache=object())


def test_unsupported_models_dtypes_and_devices_are_refused_at_start(tiny_models):
    for family in ("qwen3", "mixtral"):
        config = load_config(tiny_models[family])
        with pytest.raises(BadInputError, match=rf"serves llama, mistral, qwen2 models .* this model is '{family}'"):
            check_exportable(config, torch.float32, "cpu")
    config = load_config(tiny_models["llama"])
    with pytest.raises(BadInputError, match=r"in float32 or float16 .* not bfloat16: .* no bfloat16 MatMul"):
        check_exportable(config, torch.bfloat16, "cpu")
    check_exportable(config, torch.float16, "cpu")  # ONNX Runtime's CPU provider runs the graph's ops in float16
    with pytest.raises(BadInputError, match="not on 'cuda'"):
        check_exportable(config, torch.float32, "cuda")
    cfg = PeerConfig(model=str(tiny_models["qwen3"]), compute=ComputeConfig(runtime="onnx"))
    with pytest.raises(BadInputError, match="serve it with --runtime torch"):
        ServingStage.from_config(cfg.model, cfg.compute, cfg.cache_dir)


def test_exports_are_written_once_and_reused(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    config = load_config(folder)
    family = family_for(config)
    loads: list[Span] = []

    def layers_for(span: Span) -> torch.nn.ModuleList:
        loads.append(span)
        return load_span(folder, family, span, torch.float32, "cpu")

    export_span(tmp_path, config, Span(1, 3), layers_for)
    assert loads == [Span(1, 3)] and all(block_path(tmp_path, i).exists() for i in (1, 2))
    export_span(tmp_path, config, Span(0, 4), layers_for)  # only the blocks still missing are loaded
    assert loads == [Span(1, 3), Span(0, 4)]
    loads.clear()
    graphs = export_span(tmp_path, config, Span(0, 4), layers_for)  # a warm cache reads no torch weights
    assert loads == [] and graphs == [block_path(tmp_path, i) for i in range(4)]


def test_serving_stage_builds_the_runtime_it_is_told(tiny_models, tmp_path):
    cfg = PeerConfig(model=str(tiny_models["llama"]), cache_dir=tmp_path, compute=ComputeConfig(runtime="onnx"))
    stage = ServingStage.from_config(cfg.model, cfg.compute, cfg.cache_dir)
    runtime = stage.probe()
    assert isinstance(runtime, OnnxSpan) and runtime.span == Span(0, 1)
    assert (tmp_path / "onnx").is_dir()  # exported into the peer's cache directory
    assert isinstance(
        ServingStage.from_config(str(tiny_models["llama"]), ComputeConfig(), tmp_path).probe(), SpanBackend
    )
