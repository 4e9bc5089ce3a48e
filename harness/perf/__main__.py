"""``python -m harness.perf calibrate [--force] [--threads N]``: measure this machine's micro-benchmarks (hardware,
and the swarm's own fixed costs with real peers on loopback), cache them where the product reads them
(``swarm.perf.calibration``), and print them. ``python -m swarm.perf show|predict`` reads the cached record."""

from __future__ import annotations

import argparse
import json
import time

from harness.perf.calibrate import measure_codecs, measure_hardware
from swarm.config import default_cache_dir
from swarm.perf.calibration import Calibration, calibration_path, load, machine_key, save


def calibrated(threads: int = 1, force: bool = False) -> Calibration:
    """This machine's calibration: the cached one, or measured now (about two minutes: four small swarms)."""
    import torch

    torch.set_num_threads(threads)
    path = calibration_path(default_cache_dir(), threads)
    if not force and (cal := load(path)) is not None:
        return cal
    from harness.perf.probe import measure_software

    hardware = measure_hardware()
    software, bandwidth = measure_software(hardware)
    cal = Calibration(
        machine=machine_key(threads),
        threads=threads,
        hardware=hardware,
        transport_bandwidth=bandwidth,
        software=software,
        codecs=measure_codecs(),
        measured_at=time.time(),
    )
    save(cal, path)
    return cal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.perf", description=__doc__)
    p.add_argument("command", choices=["calibrate"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (as the benchmarks use)")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    args = p.parse_args(argv)
    print(json.dumps(calibrated(args.threads, args.force).model_dump(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
