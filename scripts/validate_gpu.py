"""GPU rows for the performance model's validation: one prepared script for a machine with a GPU (a few minutes,
random-init configs, no network). It measures this device's micro-benchmarks, then runs model shapes in one process
and compares each measurement with two predictions: from the micro-benchmarks (calibrated) and from the hardware
catalogue alone (``configs/hardware``, matched by the device's name).

    python scripts/validate_gpu.py --json gpu-rows.json              # on a GPU machine (bfloat16)
    python scripts/validate_gpu.py --device cpu --dtype float32 --small   # the same code path on a CPU (tests)

Workloads per shape: a decode step at batch 1 and 32 after 512 cached positions (tokens/s), a prefill of 2048
tokens, and forward + backward of [4, 512] with frozen blocks (gradients to the inputs, as servers compute them)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.perf.calibrate import measure_hardware  # noqa: E402
from harness.perf.validation import Row, _row, table  # noqa: E402
from swarm.perf.arch import Arch  # noqa: E402
from swarm.perf.catalogue import DeviceSpec, load_catalogue, lookup  # noqa: E402
from swarm.perf.model import Device  # noqa: E402
from swarm.perf.predict import Swarm, decode_step, forward_time, train_time  # noqa: E402

SHAPES = {  # random-init Llama shapes, cut to a few layers (per-layer costs are what is compared)
    "1B-shape x8": dict(
        hidden_size=2048,
        intermediate_size=5504,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_hidden_layers=8,
        vocab_size=32000,
    ),
    "8B-shape x4": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=32000,
    ),
}
SMALL = {
    "small x2": dict(
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=1000,
    )
}


def catalogue_device(spec: DeviceSpec, dtype: str) -> Device:
    b = 2.0 if dtype in ("float16", "bfloat16") else 4.0
    return Device(
        spec.name,
        spec.flops(dtype) * spec.matmul_efficiency,
        spec.memory_bandwidth * spec.memory_efficiency,
        b,
        spec.launch_overhead * 30,
        spec.launch_overhead * 60,
    )


def measure(cfg: dict[str, Any], dev: torch.device, dtype: torch.dtype, small: bool) -> dict[str, float]:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed(fn: Any, repeats: int = 10) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dev, dtype).eval()  # type: ignore[arg-type]
    for p in model.parameters():
        p.requires_grad_(False)
    out: dict[str, float] = {}
    past, prompt, seq = (64, 128, 64) if small else (512, 2048, 512)
    with torch.inference_mode():
        for batch in (1, 32):
            cache = DynamicCache(config=model.config)
            model(torch.randint(0, cfg["vocab_size"], (batch, past), device=dev), cache=cache, use_cache=True)
            one = torch.randint(0, cfg["vocab_size"], (batch, 1), device=dev)

            def step(one: torch.Tensor = one, cache: DynamicCache = cache) -> None:
                model(one, cache=cache, use_cache=True)
                cache.crop(-1)

            out[f"decode batch {batch}"] = batch / timed(step)
        ids = torch.randint(0, cfg["vocab_size"], (1, prompt), device=dev)
        out["prefill"] = timed(lambda: model(ids), 5)
    x = torch.randint(0, cfg["vocab_size"], (4, seq), device=dev)
    emb = model.get_input_embeddings()

    def fb() -> None:
        h = emb(x).detach().requires_grad_(True)
        model(inputs_embeds=h).logits.float().sum().backward()

    out["forward+backward"] = timed(fb, 5)
    return out


def rows_for(
    name: str, cfg: dict[str, Any], measured: dict[str, float], dev: Device, label: str, small: bool
) -> list[Row]:
    arch = Arch.from_config(cfg)
    local = Swarm(arch, dev)
    past, prompt, seq = (64, 128, 64) if small else (512, 2048, 512)
    rows = []
    for batch in (1, 32):
        cost = decode_step(local, past, batch=batch)
        rows.append(
            _row(
                "gpu",
                f"{name} decode batch {batch} [{label}]",
                "tokens/s",
                measured[f"decode batch {batch}"],
                cost,
                per=batch,
            )
        )
    rows.append(
        _row("gpu", f"{name} prefill {prompt} [{label}]", "s", measured["prefill"], forward_time(local, 1, prompt))
    )
    rows.append(
        _row(
            "gpu",
            f"{name} forward+backward [4, {seq}] [{label}]",
            "s",
            measured["forward+backward"],
            train_time(local, 4, seq, update=False),
        )
    )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as the CPU calibration and benchmarks run
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    hw = measure_hardware(7 if args.small else 15, args.device, args.dtype, rounds=1 if args.small else 3)
    b = 2.0 if args.dtype != "float32" else 4.0
    calibrated = Device(
        f"{name} (calibrated)",
        hw.flops,
        hw.bandwidth,
        b,
        hw.block_overhead,
        hw.backward_overhead,
        attention_flops=hw.attention_flops,
        elementwise_bandwidth=hw.elementwise_bandwidth,
        stream_curve=hw.stream_curve,
    )
    spec = lookup(name, load_catalogue())
    print(f"{name}: {hw}")
    rows: list[Row] = []
    for shape, cfg in (SMALL if args.small else SHAPES).items():
        cfg = dict(cfg, model_type="llama", max_position_embeddings=4096)
        measured = measure(cfg, dev, dtype, args.small)
        rows += rows_for(shape, cfg, measured, calibrated, "calibrated", args.small)
        if spec is not None:
            rows += rows_for(
                shape, cfg, measured, catalogue_device(spec, args.dtype), f"catalogue {spec.name}", args.small
            )
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps({"device": name, "hardware": hw.model_dump(), "rows": [r.as_dict() for r in rows]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
