"""The GPU check's CPU path (``scripts/gpu_check.py --device cpu --small``): the same code a GPU run takes, on a tiny
model in bfloat16 (float32 in every format is test_quantized.py's) — per format a real 2-server swarm's logits
against Hugging Face quantized the same way, decode and prefill timed, bytes per block counted — and the performance
model's rows (``validate_gpu.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a swarm of six servers, then the CPU micro-benchmarks


def test_the_gpu_check_runs_its_whole_path_on_a_cpu(tmp_path):
    out, md = tmp_path / "check.json", tmp_path / "check.md"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--small", "--json", str(out), "--table", str(md)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["dtype"], r["format"]): r for r in result["rows"]}
    assert set(rows) == {("bfloat16", f) for f in ("none", "int8", "nf4")}
    for (_, fmt), r in rows.items():
        assert r["ok"] and r["route"] == [[0, 2, fmt], [2, 4, fmt]], r
        assert r["decode_tokens_s"] > 0 and r["prefill_512_s"] > 0
    # each format's bytes as held: int8 about half of 16 bits, NF4 at most 0.3x
    sixteen = rows[("bfloat16", "none")]["bytes_per_block"]
    assert rows[("bfloat16", "int8")]["bytes_per_block"] <= 0.55 * sixteen
    assert rows[("bfloat16", "nf4")]["bytes_per_block"] <= 0.3 * sixteen
    perf = result["performance_model"]["rows"]
    assert len(perf) >= 4 and all(r["predicted"] > 0 and r["measured"] > 0 for r in perf)
    assert "| tiny llama x4 | bfloat16 | nf4 |" in md.read_text()
