"""``python -m swarm.perf calibrate [--force]``: measure this machine's micro-benchmarks (hardware, and the swarm's
own fixed costs with real peers on loopback), cache them, and print them. ``show`` prints the cached ones."""

from __future__ import annotations

import argparse
import json
import sys
import time

from swarm.config import default_cache_dir
from swarm.perf.calibrate import Calibration, calibration_path, load, machine_key, measure_hardware, save


def calibrated(threads: int = 1, force: bool = False) -> Calibration:
    """This machine's calibration: the cached one, or measured now (about two minutes: four small swarms)."""
    import torch

    torch.set_num_threads(threads)
    path = calibration_path(default_cache_dir(), threads)
    if not force and (cal := load(path)) is not None:
        return cal
    from swarm.perf.probe import measure_software

    hardware = measure_hardware()
    software, bandwidth = measure_software(hardware)
    cal = Calibration(machine=machine_key(threads), threads=threads, hardware=hardware,
                      transport_bandwidth=bandwidth, software=software, measured_at=time.time())  # fmt: skip
    save(cal, path)
    return cal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.perf", description=__doc__)
    p.add_argument("command", choices=["calibrate", "show"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (as the benchmarks use)")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    args = p.parse_args(argv)
    if args.command == "show":
        cal = load(calibration_path(default_cache_dir(), args.threads))
        if cal is None:
            print("no calibration cached for this machine: run `python -m swarm.perf calibrate`", file=sys.stderr)
            return 2
    else:
        cal = calibrated(args.threads, args.force)
    print(json.dumps(cal.model_dump(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
