"""The fleet cost model: monotone where it must be, a plausible H100 MFU, every assumption with a reason, and the
script runs and writes its plots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.perf.catalogue import DeviceSpec, load_catalogue
from swarm.perf.crossover import crossover, log_grid
from swarm.perf.fleet import (
    Pretraining,
    Serving,
    device_of,
    serve_datacenter,
    serve_swarm,
    stage_time,
    train_datacenter,
    train_swarm,
)
from swarm.perf.model import Cost, Link

ROOT = Path(__file__).resolve().parents[2]
BANDWIDTHS = [1e6, 1e7, 1.25e8, 1e9, 1e10]  # bytes/s
DELAYS = [0.0, 0.001, 0.02, 0.1, 0.3]  # s


@pytest.fixture(scope="module")
def cat() -> dict[str, DeviceSpec]:
    return load_catalogue()


def test_device_of_applies_efficiencies(cat: dict[str, DeviceSpec]) -> None:
    spec = cat["rtx3080"]
    dev = device_of(spec, kernels_per_block=30)
    assert dev.flops == pytest.approx(spec.flops("bfloat16") * spec.matmul_efficiency)
    assert dev.bandwidth == pytest.approx(spec.memory_bandwidth * spec.memory_efficiency)
    assert dev.block_overhead == pytest.approx(30 * spec.launch_overhead)
    assert dev.backward_overhead == pytest.approx(2 * dev.block_overhead)
    assert dev.memory == spec.memory_bytes


def test_stage_time_hides_overhead_under_work() -> None:
    assert stage_time(Cost(memory=1.0), 0.5).total == 1.0
    assert stage_time(Cost(memory=0.2), 0.5).total == pytest.approx(0.5)


@pytest.mark.parametrize("delay", [0.001, 0.05])
def test_more_bandwidth_never_lowers_swarm_throughput(cat: dict[str, DeviceSpec], delay: float) -> None:
    for run, wl in ((serve_swarm, Serving()), (train_swarm, Pretraining())):
        t = [run(cat["rtx3080"], 50, Link(delay=delay, bandwidth=bw), wl).throughput for bw in BANDWIDTHS]  # type: ignore[operator]
        assert all(a <= b * (1 + 1e-9) for a, b in zip(t, t[1:], strict=False)), t


def test_more_delay_never_raises_serving_throughput(cat: dict[str, DeviceSpec]) -> None:
    for bw in (1.25e7, 1.25e9):
        rs = [serve_swarm(cat["rtx3080"], 50, Link(delay=d, bandwidth=bw), Serving()) for d in DELAYS]
        assert len({r.detail["inflight_per_pipeline"] for r in rs}) == 1  # the in-flight limit does not move
        t = [r.throughput for r in rs]
        assert all(a >= b * (1 - 1e-9) for a, b in zip(t, t[1:], strict=False)), t
        assert all(a.latency <= b.latency for a, b in zip(rs, rs[1:], strict=False))


def test_more_devices_never_lower_datacenter_throughput(cat: dict[str, DeviceSpec]) -> None:
    s = [serve_datacenter(cat["h100"], n, Serving(), 450.0).throughput for n in (4, 8, 16)]
    t = [train_datacenter(cat["h100"], n, Pretraining(), 450.0).throughput for n in (4, 8, 16)]
    assert s == sorted(s) and t == sorted(t)


def test_h100_training_mfu_is_plausible(cat: dict[str, DeviceSpec]) -> None:
    r = train_datacenter(cat["h100"], 4, Pretraining(), 450.0)
    assert 0.2 <= r.detail["mfu"] <= 0.7
    assert r.cost.total == pytest.approx(1 / r.throughput)


def test_results_are_consistent(cat: dict[str, DeviceSpec]) -> None:
    r = serve_swarm(cat["rtx3080"], 50, Link(delay=0.02, bandwidth=1.25e8), Serving())
    assert r.used <= r.count == 50
    assert r.cloud_usd_per_hour == pytest.approx(50 * cat["rtx3080"].cloud_usd_per_hour)
    assert r.usd_per_mtok_cloud == pytest.approx(r.cloud_usd_per_hour / r.throughput / 3600 * 1e6)
    assert r.usd_per_mtok_owned(0.15, 8760, 3) > 0 and r.kwh_per_mtok > 0
    with pytest.raises(ValueError):
        serve_swarm(cat["rtx3080"], 5, Link(), Serving())  # 5 cards cannot hold 80 blocks


def test_every_assumption_has_a_reason(cat: dict[str, DeviceSpec]) -> None:
    rs = [
        serve_swarm(cat["rtx3080"], 50, Link(delay=0.02, bandwidth=1.25e8), Serving()),
        serve_datacenter(cat["h100"], 4, Serving(), 450.0),
        train_swarm(cat["rtx3080"], 50, Link(delay=0.02, bandwidth=1.25e8), Pretraining()),
        train_datacenter(cat["h100"], 4, Pretraining(), 450.0),
    ]
    for r in rs:
        names = {name for name, _, _ in r.assumptions}
        assert {"usable_memory", "swarm_host_usd", "links warm"} <= names
        assert any("matmul_efficiency" in n for n in names)
        for name, value, why in r.assumptions:
            assert name and value is not None and len(why) > 5, (name, value, why)


def test_crossover_grid(cat: dict[str, DeviceSpec]) -> None:
    cx = crossover(
        cat["rtx3080"], 50, cat["h100"], 4, Pretraining(), bandwidths=log_grid(1.25e6, 1.25e9, 4), delays=(0.001, 0.1)
    )
    assert len(cx.ratio) == 2 and len(cx.ratio[0]) == 4
    assert cx.ratio[0][-1] > cx.ratio[0][0]
    assert all(m is None or m in cx.bandwidths for m in cx.match + cx.cheaper)


@pytest.mark.slow  # a process of its own drawing three matplotlib plots
def test_script_writes_plots(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cost_model.py"), "--plots", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "Verdict" in out.stdout and "Assumptions" in out.stdout
    for name in ("serving-crossover.png", "training-crossover.png", "throughput-vs-bandwidth.png"):
        assert (tmp_path / name).stat().st_size > 1000
