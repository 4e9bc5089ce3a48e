"""The performance model against measurement: every benchmark's measured numbers next to what ``swarm.perf``
predicts for the same workload on this machine, in one table, each within 25% or marked.

    python scripts/validate_model.py                    # calibrate (cached), run the benchmarks, print the table
    python scripts/validate_model.py --results DIR --no-run          # re-price runs saved in DIR
    python scripts/validate_model.py --skip wan                      # without the WAN benchmark (no root needed)

The model's parameters come only from the catalogue and from ``python -m harness.perf calibrate`` (micro-benchmarks
on this machine: a GEMM, attention, memory streams, a block of hidden size 64, and a 2-layer model of hidden size
64 served by real peers); nothing is fitted to the runs below. Runs: ``bench_inference.py`` (tiny Llama through 2
peers, SmolLM2-135M through 3), ``bench_finetune.py`` (LoRA on SmolLM2, 3 peers), ``bench_pretrain.py`` (the tiny
run, 3 stages) and ``bench_wan.py`` (tiny Llama through 4 peers on loopback and behind links a, b and c; chained and
client-mediated; exact and block8-compressed)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.perf.validation import Row, predict_rows, table  # noqa: E402

BENCHES = {
    "inference": ["scripts/bench_inference.py", "--repeats", "5"],
    "finetune": ["scripts/bench_finetune.py", "--steps", "5"],
    "pretrain": ["scripts/bench_pretrain.py", "--steps", "20", "--plot", "/dev/null"],
    "wan": [
        "scripts/bench_wan.py",
        "--models",
        "tiny-llama",
        "--planes",
        "direct",
        "--codec",
        "block8",
        "--repeats",
        "3",
    ],
}


def run(name: str, out: Path, log: Path) -> None:
    cmd = [sys.executable, *BENCHES[name], "--json", str(out)]
    t0 = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(cmd[1:])}", flush=True)
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}); see {log}")
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("validation"), help="where the runs' JSON and logs go")
    p.add_argument("--no-run", action="store_true", help="price the runs already saved in --results")
    p.add_argument("--skip", nargs="*", default=[], choices=list(BENCHES))
    p.add_argument("--recalibrate", action="store_true", help="measure the micro-benchmarks again")
    p.add_argument("--json", type=Path, default=None, help="write the table's rows here")
    args = p.parse_args()

    from harness.perf.__main__ import calibrated

    cal = calibrated(1, args.recalibrate)
    args.results.mkdir(parents=True, exist_ok=True)
    measured: dict[str, Any] = {}
    for name in BENCHES:
        if name in args.skip:
            continue
        out = args.results / f"{name}.json"
        if not args.no_run:
            run(name, out, args.results / f"{name}.log")
        if out.exists():
            measured[name] = json.loads(out.read_text())
    rows: list[Row] = predict_rows(cal, measured)
    print(f"\ncalibration: {cal.machine}")
    h = cal.hardware
    print(
        f"  linear {h.flops / 1e9:.0f} GFLOP/s, attention {h.attention_flops / 1e9:.0f} GFLOP/s, streaming "
        f"{h.bandwidth / 1e9:.1f} GB/s, element-wise {h.elementwise_bandwidth / 1e9:.1f} GB/s, block call "
        f"{h.block_overhead * 1e3:.2f} ms (backward {h.backward_overhead * 1e3:.2f} ms), transport "
        f"{cal.transport_bandwidth / 1e6:.0f} MB/s"
    )
    print("  software (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cal.software.items()))
    print()
    print(table(rows))
    within = sum(1 for r in rows if abs(r.error) <= 0.25)
    print(f"\n{within} of {len(rows)} predictions within 25% of the measurement")
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
