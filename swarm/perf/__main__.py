"""``python -m swarm.perf predict --model smollm2-135m --spans 0:10 10:20 20:30 --device rtx3080 --delay-ms 20
--mbps 100``: what such a swarm would deliver (decode, time to first token, forward, LoRA fine-tuning), with each
prediction's breakdown. ``--device this`` uses this machine's calibration; the swarm's software costs are this
machine's calibrated ones when cached (else left out, and said). ``show`` prints the cached calibration.

The calibration itself is measured by the harness, from a checkout: ``python -m harness.perf calibrate``."""

from __future__ import annotations

import argparse
import json
import sys

from swarm.config import default_cache_dir
from swarm.perf.calibration import calibration_path, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.perf", description=__doc__)
    p.add_argument("command", choices=["show", "predict"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (as the benchmarks use)")
    p.add_argument("--model", default="smollm2-135m", help="predict: a model card name or Hugging Face folder")
    p.add_argument("--spans", nargs="+", default=None, help="predict: the servers' spans, in order (default: one)")
    p.add_argument("--device", default="this", help="predict: the servers' device (a configs/hardware name, or this)")
    p.add_argument("--client-device", default="this", help="predict: the client's device")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--delay-ms", type=float, default=0.0, help="predict: one-way delay between any two parties")
    p.add_argument("--mbps", type=float, default=None, help="predict: each party's link, Mbit/s (default: unlimited)")
    p.add_argument("--prompt", type=int, default=512, help="predict: prompt tokens")
    args = p.parse_args(argv)
    cal = load(calibration_path(default_cache_dir(), args.threads))
    if args.command == "predict":
        from swarm.perf.report import predict_report

        print(predict_report(args, cal))
        return 0
    if cal is None:
        print(
            "no calibration cached for this machine: run `python -m harness.perf calibrate` from a checkout",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(cal.model_dump(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
