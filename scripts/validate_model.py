"""The performance model against measurement: every benchmark's measured numbers next to what ``swarm.perf``
predicts for the same workload on this machine, each within 25% or marked; compute-bound rows (one process or
loopback) summarised apart from delay-bound ones (behind emulated links), and in-sample runs apart from held-out ones.

    python scripts/validate_model.py --recalibrate --record docs/perf/validation-DATE.json   # the reported run
    python scripts/validate_model.py --results DIR --no-run          # re-price runs saved in DIR
    python scripts/validate_model.py --skip wan heldout-wan          # without the WAN benchmark (no root needed)
    python scripts/validate_model.py --report docs/perf/validation-DATE.json     # the docs' summary and tables
    python scripts/validate_model.py --reprice docs/perf/validation-DATE.json    # ...priced again from its raw runs

The model's parameters come only from the catalogue and from ``python -m harness.perf calibrate`` (micro-benchmarks
on this machine: a GEMM, attention, memory streams, a block of hidden size 64, and a 3-layer model of hidden size
64 served by real peers); no number is fitted to the runs below. Its STRUCTURE (which terms it has) was developed
on the in-sample runs: ``bench_inference.py`` (tiny Llama through 2 peers, SmolLM2-135M through 3),
``bench_finetune.py`` (LoRA on SmolLM2, 3 peers), ``bench_pretrain.py`` (the tiny run, 3 stages) and ``bench_wan.py``
(tiny Llama through 4 peers on loopback and behind links a, b and c; chained and client-mediated; exact and
block8-compressed). The held-out runs (``heldout-*``) are a model shape and a span count it was never developed on:
``mid-llama`` (hidden 512, 10 layers, grouped-query attention 8/2) through 5 peers, on loopback and behind links.

``--record`` writes the whole run to one JSON file: the machine (its core count, measured, and its load before and
after), the commands, the calibration, every benchmark's raw output, the rows and the summary. ``--report`` prints
what ``docs/cost-model.md`` shows of such a record (a unit test holds the page to it)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.perf.validation import Row, predict_rows, report, summary, table  # noqa: E402

HELD_OUT_SPANS = ["0:2", "2:4", "4:6", "6:8", "8:10"]  # mid-llama's 10 blocks over 5 peers
BENCHES = {
    "inference": ["scripts/bench_inference.py", "--models", "tiny-llama", "smollm2-135m", "--repeats", "5"],
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
    # held out: a model shape and a span count the model's structure was never developed on
    "heldout-inference": ["scripts/bench_inference.py", "--models", "mid-llama", "--repeats", "5"],
    "heldout-finetune": [
        "scripts/bench_finetune.py",
        "--model",
        "mid-llama",
        "--spans",
        *HELD_OUT_SPANS,
        "--steps",
        "5",
    ],
    "heldout-wan": [
        "scripts/bench_wan.py",
        "--models",
        "mid-llama",
        "--links",
        "a",
        "c",
        "--planes",
        "direct",
        "--tasks",
        "decode",
        "ttft",
        "finetune",
        "--repeats",
        "3",
    ],
}


def machine() -> dict[str, Any]:
    """What the run's numbers depend on beyond the calibration: the cores this process may use (every party of a
    benchmark shares them), and the load."""
    return {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
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


def run_files(measured: dict[str, Any]) -> dict[str, str]:
    """The pre-training run files the raw outputs name (bench_wan writes them to a temporary folder): kept in the
    record, so that it can be priced again anywhere."""
    paths = {d["run"] for d in measured.values() if isinstance(d, dict) and "run" in d}
    for d in measured.values():
        paths |= {r["pretrain_run"] for r in d.get("results", []) if isinstance(r, dict) and "pretrain_run" in r}
    return {p: Path(p).read_text() for p in sorted(paths) if Path(p).is_file()}


def with_files(measured: dict[str, Any], files: dict[str, str], folder: Path) -> dict[str, Any]:
    """``measured`` with each run file it names written to ``folder`` and named there instead."""
    text = json.dumps(measured)
    for i, (path, content) in enumerate(files.items()):
        fresh = folder / f"run{i}-{Path(path).name}"
        fresh.write_text(content)
        text = text.replace(json.dumps(path), json.dumps(str(fresh)))
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def show(rows: list[Row]) -> None:
    print(table(rows))
    print()
    for line in summary(rows):
        print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("validation"), help="where the runs' JSON and logs go")
    p.add_argument("--no-run", action="store_true", help="price the runs already saved in --results")
    p.add_argument("--skip", nargs="*", default=[], choices=list(BENCHES))
    p.add_argument("--recalibrate", action="store_true", help="measure the micro-benchmarks again")
    p.add_argument("--json", type=Path, default=None, help="write the table's rows here")
    p.add_argument("--record", type=Path, default=None, help="write the whole run here (see above)")
    p.add_argument("--report", type=Path, default=None, help="print a record's summary and tables, then exit")
    p.add_argument("--reprice", type=Path, default=None, help="price a record's raw runs again, then exit")
    args = p.parse_args()

    from swarm.perf.calibration import Calibration

    if args.report:
        record = json.loads(args.report.read_text())
        print(report([Row.from_dict(r) for r in record["rows"]]))
        return 0
    if args.reprice:
        record = json.loads(args.reprice.read_text())
        cal = Calibration.model_validate(record["calibration"])
        with tempfile.TemporaryDirectory() as tmp:
            measured = with_files(record["runs"], record.get("files", {}), Path(tmp))
            show(predict_rows(cal, measured, record["machine"]["cores"]))
        return 0

    from harness.perf.__main__ import calibrated

    before = machine()
    started = time.time()
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
    after = machine()
    rows: list[Row] = predict_rows(cal, measured, before["cores"])
    print(f"\ncalibration: {cal.machine}; {before['cores']} cores measured (os.sched_getaffinity)")
    h = cal.hardware
    print(
        f"  linear {h.flops / 1e9:.0f} GFLOP/s, attention {h.attention_flops / 1e9:.0f} GFLOP/s, streaming "
        f"{h.bandwidth / 1e9:.1f} GB/s, element-wise {h.elementwise_bandwidth / 1e9:.1f} GB/s, block call "
        f"{h.block_overhead * 1e3:.2f} ms (backward {h.backward_overhead * 1e3:.2f} ms), transport "
        f"{cal.transport_bandwidth / 1e6:.0f} MB/s"
    )
    print("  software (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cal.software.items()))
    print()
    show(rows)
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    if args.record:
        record = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": before | {"loadavg_after": after["loadavg"]},
            "commands": {name: BENCHES[name] for name in measured},
            "calibration": cal.model_dump(),
            "runs": measured,
            "files": run_files(measured),
            "rows": [r.as_dict() for r in rows],
            "summary": summary(rows),
        }
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
