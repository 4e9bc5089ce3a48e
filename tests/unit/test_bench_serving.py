"""``scripts/bench_serving.py``'s arithmetic (``harness.serving_load``): the percentiles, Jain's index and the row it
makes of timed streams, and the benchmark's guard against a server flag argparse would silently take for a longer
one."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from harness import serving_load as load
from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_serving")  # only the standard library at import: workers import the rest


def test_percentile_matches_numpy():
    rng = random.Random(3)
    for n in (1, 2, 5, 31, 500):
        values = [rng.expovariate(10) for _ in range(n)]
        for q in (0, 10, 50, 95, 100):
            assert load.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert math.isnan(load.percentile([], 50))


def test_jain():
    assert load.jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert load.jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one of four gets everything: 1/n
    assert load.jain([1.0, 2.0]) == pytest.approx(9 / 10)  # (1+2)^2 / (2 * (1+4))
    assert math.isnan(load.jain([]))


def test_summarize_two_streams():
    # stream a: sent at 0, tokens at 1, 2, 3 (3 tokens in 3 s); b: sent at 0.5, tokens at 1.5, 3.5 (2 in 3 s)
    a = {"start": 10.0, "times": [11.0, 12.0, 13.0], "tokens": 3}
    b = {"start": 10.5, "times": [11.5, 13.5], "tokens": 2}
    row = load.summarize([a, b])
    assert row["streams"] == 2 and row["tokens"] == 5 and row["fewest_tokens"] == 2
    assert row["wall_s"] == pytest.approx(3.5)  # first request to last token
    assert row["tokens_per_s"] == pytest.approx(5 / 3.5)
    assert row["tbt_p50_s"] == pytest.approx(1.0)  # gaps 1, 1, 2
    assert row["tbt_p95_s"] == pytest.approx(1.9)
    assert row["jain"] == pytest.approx(load.jain([1.0, 2 / 3]))
    assert row["ttft_p50_s"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="1 of 2 streams got no token"):
        load.summarize([a, {"start": 10.0, "times": [], "tokens": 0}])


def test_prompts_differ():
    prompts = [load.prompt(i) for i in range(64)]
    assert len(set(prompts)) == 64


def test_unknown_server_flag_is_refused(bench):
    known = {"--model", "--max-batch-tokens", "--threads"}
    bench.check_flags("--unbatched-args", ["--threads", "1"], known)
    with pytest.raises(SystemExit, match="--max-batch"):  # argparse alone would run --max-batch-tokens 1
        bench.check_flags("--unbatched-args", ["--max-batch", "1"], known)
    with pytest.raises(SystemExit, match="--max-batch"):
        bench.check_flags("--unbatched-args", ["--max-batch=1"], known)


def test_the_swarm_is_measured_against_one_process_s_batch_of_the_same_streams(capsys):
    from harness.serving_report import Run, report, targets

    def row(n: int, tps: float, p50: float, **over) -> dict:
        r = dict(streams=n, tokens=32 * n, fewest_tokens=32, tokens_per_s=tps, tbt_p50_s=p50, tbt_p95_s=p50 * 2)
        return {**r, "jain": 0.99, "ttft_p50_s": 0.5, "wall_s": 1.0, **over}

    machine = dict(host="h", cores=2, cpu="c", memory_gib=1, python="3", torch="t", commit="x")
    run = Run({**machine, "load_start": (1, 1, 1), "load_end": (1, 1, 1)}, ["loopback"], 32, 1, "", "--max-batch 1")
    run.rows += [dict(net="loopback", mode="batched", path="api", **row(1, 13.0, 0.08))]
    run.rows += [dict(net="loopback", mode="batched", path="api", **row(16, 70.0, 0.21))]
    run.ceiling, run.ceiling_threads = {1: row(1, 15.0, 0.06), 16: row(16, 100.0, 0.14)}, 2
    lines = targets(run, "loopback", "batched")
    assert "FAIL [loopback batched api] 16 stream(s): 0.70x one process's batch of 16 (>= 0.75x)" in lines
    assert "PASS [loopback batched api] 1 stream(s): 0.87x one process's batch of 1 (>= 0.85x)" in lines
    assert "FAIL [loopback batched api] p50 time between tokens 2.62x one stream's (<= 2.5x)" in lines
    report(run)
    out = capsys.readouterr().out
    assert "## the ceiling" in out and "0.70x" in out  # the table's column beside the 16-stream row
