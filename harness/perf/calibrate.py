"""Micro-benchmarks, measured once per machine and cached: what the performance model's parameters are on this
machine. None of them runs a workload the model is validated against:

- matmul FLOP/s: a float32 linear layer (``x @ W.T``, as every projection is) of 512 tokens through a 512 x 16384
  weight matrix: 32 MiB of weights, more than the caches hold, as a model's layers are read from memory;
- attention FLOP/s: causal scaled-dot-product attention over 512 positions, 8 heads of 64;
- memory bandwidth: a matrix-vector product over a 64 MiB matrix; and, as decoding reads a model's weights, one
  token through weight matrices of 0.25, 1, 4 and 16 MiB, each size cycling through 256 MiB of them (more than the
  caches hold: small matrices stream slower, each call ramping up anew); and an
  RMS norm and a rotary rotation of a [512, 512] tensor (1 MiB: a prompt's activations), counted as 18 passes;
- the framework's fixed cost per block: a Llama decoder layer of hidden size 64 (too small for its arithmetic to
  count), forward on one token against a KV cache, and forward + backward on 8 tokens, layers 1 and 8 of a stack
  compared so that the stack's own fixed cost cancels;
- the swarm's own fixed costs (``harness.perf.probe``): a 3-layer model of hidden size 64 served by one and by three
  real peers on this machine, and the transport's bandwidth with a 16 MiB probe.

The numbers go into ``swarm.perf.calibration.Calibration``, the record the product reads."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from swarm.perf.calibration import Hardware

MICRO = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _median_time(
    fn: Callable[[], object], repeats: int, inner: int = 1, sync: Callable[[], None] = lambda: None
) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def measure_hardware(repeats: int = 15, device: str = "cpu", dtype: str = "float32", rounds: int = 3) -> Hardware:
    """The micro-benchmarks, ``rounds`` times, each number the median of its rounds: a shared machine has
    transients (a neighbour's burst) that one round can fall into."""
    runs = [_measure_hardware(repeats, device, dtype) for _ in range(rounds)]

    def mid(values: list[Any]) -> Any:
        return sorted(values)[len(values) // 2]

    curve = tuple((size, mid([r.stream_curve[i][1] for r in runs])) for i, (size, _) in enumerate(runs[0].stream_curve))
    fields = {k: mid([getattr(r, k) for r in runs]) for k in Hardware.model_fields if k != "stream_curve"}
    return Hardware(**fields, stream_curve=curve)


def _measure_hardware(repeats: int, device: str, dtype: str) -> Hardware:
    """One round of the micro-benchmarks on ``device`` in ``dtype``. On a GPU the shapes are scaled up (a GEMM of
    8192 tokens through 8192 x 8192 weights, attention over 4096 positions of 32 heads of 128, 1 GiB streamed) so
    that they measure the device rather than kernel launches."""
    import torch
    import torch.nn.functional as F

    dev, dt = torch.device(device), getattr(torch, dtype)
    size = 2 if dt in (torch.float16, torch.bfloat16) else 4
    gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if gpu else (lambda: None)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt)

    with torch.inference_mode():
        t, k, n = (8192, 8192, 8192) if gpu else (512, 512, 16384)
        a, b = rand(t, k), rand(n, k)
        flops = 2 * t * k * n / _median_time(lambda: F.linear(a, b), repeats, sync=sync)
        heads, seq, hd = (32, 4096, 128) if gpu else (8, 512, 64)
        q = rand(1, heads, seq, hd)
        attention = (
            2
            * seq
            * seq
            * hd
            * heads
            / _median_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), repeats, 2, sync)
        )
        rows = 16384 if gpu else 4096
        m, v = rand(rows, rows * 2 if gpu else rows), rand(rows * 2 if gpu else rows)
        bandwidth = m.numel() * size / _median_time(lambda: torch.mv(m, v), repeats, 2, sync)
        side = 8192 if gpu else 512
        x, w = rand(side, side), rand(side)

        def norm_and_rotary() -> torch.Tensor:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # 7 passes
            return torch.cat((-y[:, side // 2 :], y[:, : side // 2]), -1) * w + y * w  # 11 passes

        for _ in range(50):  # the steady state a model's process runs in: the allocator reuses freed outputs
            norm_and_rotary()
        elementwise = 18 * x.numel() * size / _median_time(norm_and_rotary, repeats, 10, sync)
        curve = []
        for mib in (1, 4, 16, 64) if gpu else (0.25, 1, 4, 16):
            cols = 512  # rows of 512 values: a small model's layer width
            mats = [
                rand(max(1, int(mib * 2**20 / size / cols)), cols) for _ in range(int((1024 if gpu else 256) / mib))
            ]
            one = rand(1, cols)
            total = sum(m.numel() for m in mats) * size
            seconds = _median_time(_through(one, mats), 5, sync=sync)
            curve.append((mib * 2**20, total / seconds))
    return Hardware(
        flops=flops,
        attention_flops=attention,
        bandwidth=bandwidth,
        elementwise_bandwidth=elementwise,
        stream_curve=tuple(curve),
        **_block_overheads(repeats, dev, dt, sync),
    )


def measure_codecs(repeats: int = 15) -> dict[str, tuple[float, float]]:
    """What compressing and decompressing an activation costs (``swarm.codecs``, both ends on this CPU): a tensor of
    256 values and one of 131,072, giving a fixed part per tensor and a part per float32 byte."""
    import torch

    from swarm.codecs import Codec, compress, decompress

    out = {}
    for codec in (Codec.float16, Codec.bfloat16, Codec.block8):
        times = []
        for n in (256, 131072):
            x = torch.randn(1, n)

            def round_trip(x: torch.Tensor = x, codec: Codec = codec) -> None:
                part = compress(x, codec, "float32")
                if part is not None:
                    decompress(part)

            times.append(_median_time(round_trip, repeats))
        per_byte = max(times[1] - times[0], 0.0) / ((131072 - 256) * 4)
        out[codec.value] = (max(times[0] - 256 * 4 * per_byte, 0.0), per_byte)
    return out


def _through(x: Any, mats: list[Any]) -> Callable[[], object]:
    """One token through each matrix in turn."""
    import torch.nn.functional as F

    return lambda: [F.linear(x, m) for m in mats]


def _stack(layers: int, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model: Any = LlamaModel(LlamaConfig(**MICRO, num_hidden_layers=layers))  # type: ignore[arg-type]
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _block_overheads(repeats: int, device: Any, dtype: Any, sync: Callable[[], None]) -> dict[str, float]:
    """(t(8 layers) - t(1 layer)) / 7 for a one-token step against a 16-position cache, and the same for forward +
    backward over 8 tokens (weights frozen, gradients to the input, as servers compute them)."""
    import torch
    from transformers import DynamicCache

    def step_time(layers: int) -> float:
        model = _stack(layers, device, dtype)
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(inputs_embeds=torch.randn(1, 16, 64, device=device, dtype=dtype), cache=cache, use_cache=True)
            one = torch.randn(1, 1, 64, device=device, dtype=dtype)

            def step() -> None:
                model(inputs_embeds=one, cache=cache, use_cache=True)
                cache.crop(-1)  # back to 16 positions

            return _median_time(step, repeats, 20, sync)

    def train_time(layers: int, weights: bool = False) -> float:
        model = _stack(layers, device, dtype)
        for p in model.parameters():
            p.requires_grad_(weights)
        x = torch.randn(1, 8, 64, device=device, dtype=dtype, requires_grad=True)

        def fb() -> None:
            model(inputs_embeds=x).last_hidden_state.sum().backward()

        def f() -> None:
            with torch.no_grad():
                model(inputs_embeds=x)

        return _median_time(fb, repeats, 5, sync) - _median_time(f, repeats, 5, sync)

    forward = max((step_time(8) - step_time(1)) / 7, 0.0)
    backward = max((train_time(8) - train_time(1)) / 7, 0.0)
    weights = max((train_time(8, True) - train_time(1, True)) / 7, 0.0)
    return {
        "block_overhead": forward,
        "backward_overhead": backward,
        "weights_backward_overhead": weights,
        "optimizer_overhead": _optimizer_overhead(repeats, device, dtype, sync),
    }


def _optimizer_overhead(repeats: int, device: Any, dtype: Any, sync: Callable[[], None]) -> float:
    """Seconds per parameter tensor of an AdamW step (PyTorch's default implementation): 80 tensors of 64 values
    against 10."""
    import torch

    def step_time(n: int) -> float:
        params = [torch.zeros(64, device=device, dtype=dtype, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _median_time(opt.step, repeats, 5, sync)

    return max((step_time(80) - step_time(10)) / 70, 0.0)
