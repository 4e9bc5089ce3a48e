"""The GPU check, prepared to run in one go (no hub access; a few minutes on one large GPU): real swarms of 2 servers
on the device, per model, dtype and quantization format:

- logits of the swarm against Hugging Face's model on the same device, in the same dtype, quantized the same way
  (``peers.blocks.quantize``), within the self-check's bound for the dtype (``swarm.families.selfcheck``);
- decode tokens/s (32 greedy tokens after a 16-token prompt) and prefill time (512 tokens) through the swarm;
- bytes one block takes on the device in each format;

then the performance model's GPU rows (``scripts/validate_gpu.py``, run by this script). Models: SmolLM2-135M from
its package, random-initialised Llamas of the widths of 1B (8 blocks) and 8B (4 blocks) models. Every format's two
servers (``0:h`` and ``h:n``) join one swarm per model and dtype; each client pins one format by its fingerprint.
It writes one JSON (``--json``) and one Markdown table (``--table``), and prints the table.

    python scripts/gpu_check.py --json gpu.json --table gpu.md              # on a machine with a GPU
    python scripts/gpu_check.py --device cpu --small --json out.json        # the same code path on a CPU (the suite)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FORMATS = ("none", "int8", "nf4")
SHAPES = {  # random-initialised Llamas, cut to a few blocks (per-block costs and exactness are what is checked)
    "llama-1B-shape x8": dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=8
    ),
    "llama-8B-shape x4": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=4
    ),
}
SMALL = {
    "tiny llama x4": dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4
    )
}


def random_model(folder: Path, shape: dict[str, int]) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, vocab_size=32000, max_position_embeddings=4096))
    with torch.no_grad():  # norms of 1 would hide a norm applied twice or not at all
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.05)
    model.save_pretrained(folder)
    return folder


def reference(folder: Path, fmt: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    from peers.blocks.quantize import quantize_layer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    for layer in model.model.layers:
        quantize_layer(layer, fmt, dtype, torch.device(device))
    return model


def block_bytes(folder: Path, fmt: str, dtype: torch.dtype, device: str) -> int:
    from peers.blocks.families import family_for
    from peers.blocks.quantize import held_bytes, load_quantized
    from swarm.families.weights import load_layers
    from swarm.model_files import load_config

    family = family_for(load_config(folder), dtype)
    (layer,) = load_quantized(lambda ids: load_layers(family, folder, ids, dtype, device), [0], fmt, dtype, device)
    return held_bytes(layer)


def check_model(label: str, folder: Path, dtype: torch.dtype, device: str, cache: Path) -> list[dict[str, Any]]:
    """One swarm: two servers per format; per format a client pinned to it, against the same-device reference."""
    from harness.fork_server import ForkServer

    # on a CPU the six servers fork from one process that imported torch and the rest once (``harness.fork_server``);
    # never on a GPU: a process forked after CUDA was touched cannot use it
    spawner = ForkServer() if device == "cpu" else None
    try:
        return _check_formats(label, folder, dtype, device, cache, spawner)
    finally:
        if spawner is not None:
            spawner.close()


def _check_formats(
    label: str, folder: Path, dtype: torch.dtype, device: str, cache: Path, spawner: Any
) -> list[dict[str, Any]]:
    from swarm import DistributedModelForCausalLM
    from swarm.families.selfcheck import TOLERANCES
    from swarm.launch import LocalSwarm
    from swarm.model_files import load_config, weights_fingerprint
    from swarm.quantization import weights_format

    name = str(dtype).removeprefix("torch.")
    n = int(load_config(folder).num_hidden_layers)
    spans: list[str | None] = [f"0:{n // 2}", f"{n // 2}:{n}"]
    common = ("--device", device, "--dtype", name, "--throughput", "100")
    rows = []
    with LocalSwarm(str(folder), spans, extra_args=common, startup_timeout=600, spawner=spawner) as swarm:
        for fmt in FORMATS[1:]:
            for span in spans:
                swarm.add_peer(span, "--quantize", fmt, wait=False)
        for peer in swarm.peers:
            peer.wait_ready(600)
        for fmt in FORMATS:
            fingerprint = weights_fingerprint(folder, weights_format(name, fmt), cache)
            ref = reference(folder, fmt, dtype, device)
            with DistributedModelForCausalLM.from_pretrained(
                str(folder), initial_peers=swarm.initial_peers, dtype=dtype, fingerprint=fingerprint, codec="none"
            ) as client:
                ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    ours = client(ids).logits.float()
                    theirs = ref(ids.to(device)).logits.float().cpu()
                diff = (ours - theirs).abs().max().item() / max(1.0, theirs.abs().max().item())
                route = [(h.start, h.end, h.quantization) for h in client.route]
                client.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
                t = time.perf_counter()
                out = client.generate(ids, max_new_tokens=32, do_sample=False)
                decode = (out.shape[1] - ids.shape[1] - 1) / (time.perf_counter() - t)
                long = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(1))
                with torch.no_grad():
                    t = time.perf_counter()
                    client(long)
                    prefill = time.perf_counter() - t
            del ref
            rows.append(
                dict(
                    model=label,
                    dtype=name,
                    format=fmt,
                    max_rel_logit_diff=diff,
                    bound=TOLERANCES[dtype],
                    ok=diff <= TOLERANCES[dtype] and all(q == fmt for _, _, q in route),
                    route=route,
                    decode_tokens_s=decode,
                    prefill_512_s=prefill,
                    bytes_per_block=block_bytes(folder, fmt, dtype, device),
                )
            )
            r = rows[-1]
            print(
                f"{label} {name} {fmt}: diff {diff:.1e} (bound {r['bound']:.0e}) ok={r['ok']} "
                f"decode {decode:.1f} tok/s prefill-512 {prefill:.3f} s {r['bytes_per_block'] / 2**20:.1f} MiB/block",
                flush=True,
            )
    return rows


def table(device: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"GPU check on {device}",
        "",
        "| model | dtype | format | logits vs HF (rel.) | ok | decode tok/s | prefill 512 (s) | MiB/block |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['format']} | {r['max_rel_logit_diff']:.1e} | {r['ok']} | "
            f"{r['decode_tokens_s']:.1f} | {r['prefill_512_s']:.3f} | {r['bytes_per_block'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model in bfloat16 (the CPU path)")
    p.add_argument("--no-perf", action="store_true", help="skip the performance model's rows (validate_gpu.py)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--table", type=Path, default=None)
    args = p.parse_args()
    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import model_folder

    torch.set_num_threads(1)
    cache = default_cache_dir()
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-check-") as tmp:
        models: list[tuple[str, Path, tuple[torch.dtype, ...]]] = []
        for label, shape in (SMALL if args.small else SHAPES).items():
            dtypes = (torch.bfloat16,)  # float32 spans in every format: tests/integration/test_quantized.py
            models.append((label, random_model(Path(tmp) / label.replace(" ", "_"), shape), dtypes))
        if not args.small:
            smol = model_folder(load_model_card("smollm2-135m"), cache)
            models.insert(0, ("SmolLM2-135M", smol, (torch.bfloat16, torch.float16)))
        for label, folder, dtypes in models:
            for dtype in dtypes:
                rows += check_model(label, folder, dtype, args.device, cache)
        perf: dict[str, Any] | None = None
        if not args.no_perf:
            out = Path(tmp) / "perf.json"
            cmd = [
                sys.executable,
                str(ROOT / "scripts" / "validate_gpu.py"),
                "--device",
                args.device,
                "--json",
                str(out),
            ]
            cmd += ["--small", "--dtype", "float32"] if args.small else []
            subprocess.run(cmd, check=True, timeout=600)
            perf = json.loads(out.read_text())
    text = table(device, rows)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": rows, "performance_model": perf}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
