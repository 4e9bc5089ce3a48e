"""``python -m swarm.perf predict``: a described swarm's predictions, printed with their breakdowns."""

from __future__ import annotations

import argparse
import math

from swarm.perf.arch import Arch
from swarm.perf.calibration import Calibration
from swarm.perf.catalogue import load_catalogue
from swarm.perf.fleet import device_of
from swarm.perf.model import Cost, Device, Link, Software
from swarm.perf.predict import Swarm, decode_step, forward_time, train_time, ttft, uniform


def arch_of(model: str) -> Arch:
    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import load_config, model_folder

    return Arch.from_config(load_config(model_folder(load_model_card(model), default_cache_dir())))


def spans_of(spans: list[str]) -> list[tuple[int, int]]:
    return [(int(s.split(":")[0]), int(s.split(":")[1])) for s in spans]


def lora_params(arch: Arch, rank: int, targets: tuple[str, ...]) -> int:
    q = arch.heads * arch.head_dim
    size = {
        "q_proj": (arch.hidden, q),
        "k_proj": (arch.hidden, arch.kv_dim),
        "v_proj": (arch.hidden, arch.kv_dim),
        "o_proj": (q, arch.hidden),
    }
    return arch.layers * sum(rank * (size[t][0] + size[t][1]) for t in targets)


def _device(name: str, dtype: str, cal: Calibration | None) -> Device:
    if name == "this":
        if cal is None:
            raise SystemExit(
                "no calibration cached for this machine: run `python -m harness.perf calibrate` from a checkout"
            )
        return cal.device()
    catalogue = load_catalogue()
    if name not in catalogue:
        raise SystemExit(f"unknown device {name!r}: one of {', '.join(sorted(catalogue))}, or this")
    return device_of(catalogue[name], dtype)


def _line(name: str, value: str, cost: Cost) -> str:
    total = cost.total or math.inf
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in cost.as_dict().items() if k != "total" and v > 0)
    return f"  {name:<34} {value:>16}   ({shares})"


def predict_report(args: argparse.Namespace, cal: Calibration | None) -> str:
    arch: Arch = arch_of(args.model)
    server, client = _device(args.device, args.dtype, cal), _device(args.client_device, "float32", cal)
    spans = spans_of(args.spans) if args.spans else [(0, arch.layers)]
    bandwidth = args.mbps * 1e6 / 8 if args.mbps else math.inf
    if cal is not None:
        bandwidth = 1 / (1 / bandwidth + 1 / cal.transport_bandwidth)
    software = cal.costs() if cal is not None else Software()
    link = Link(delay=args.delay_ms / 1e3, bandwidth=bandwidth)
    sw = uniform(arch, spans, server, client, link, software)
    local = Swarm(arch, server, software=software)
    out = [
        f"{args.model} ({arch.params / 1e6:.0f}M parameters) on {len(spans)} x {server.name}, client on "
        f"{client.name}; links: {args.delay_ms:g} ms one way, "
        f"{f'{args.mbps:g} Mbit/s' if args.mbps else 'unlimited'}"
    ]
    if cal is None:
        out.append("  (no calibration cached: the swarm's software costs are left out)")
    for chained in (True, False):
        step = decode_step(sw, args.prompt, chained)
        out.append(_line(f"decode, {'chained' if chained else 'client-mediated'}", f"{1 / step.total:.1f} tok/s", step))
    out.append(
        _line(
            "decode, the model in one process",
            f"{1 / decode_step(local, args.prompt).total:.1f} tok/s",
            decode_step(local, args.prompt),
        )
    )
    first = ttft(sw, args.prompt)
    out.append(_line(f"time to first token ({args.prompt} tokens)", f"{first.total:.3f} s", first))
    fwd = forward_time(sw, 1, args.prompt)
    out.append(_line(f"forward [1, {args.prompt}]", f"{fwd.total:.3f} s", fwd))
    lora = train_time(sw, 4, 128, adapter_params=lora_params(arch, 8, ("q_proj", "k_proj", "v_proj", "o_proj")))
    out.append(_line("LoRA r=8 step, batch 4 x 128", f"{1 / lora.total:.3f} steps/s", lora))
    return "\n".join(out)
