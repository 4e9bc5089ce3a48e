"""A replica that goes wrong once: a real ``swarm.serve`` peer of a trainable stage that, right after it applies step
``--drift-at``, adds ``--drift-by`` to every one of its weights (as a flipped bit, a bad copy or a broken kernel
would), then goes on as an honest replica. For testing that replicas found apart are healed
(``peers/training/replica_health.py``, tests/integration/test_replica_heal.py).

    python -m harness.drift --drift-at 3 --drift-by 0.5 [swarm.serve arguments...]

Started in a test with ``LocalSwarm.add_peer(span, "--drift-at", "3", main="harness.drift")``."""

from __future__ import annotations

import argparse
import sys


def install(at: int, by: float) -> None:
    import torch

    from peers.training.span_trainer import SpanTrainer

    honest = SpanTrainer.apply_step

    def apply_step(self: SpanTrainer, finish: bool = True) -> None:
        honest(self, finish)
        if self.step == at:
            with torch.no_grad():
                for p in self.params:
                    p.add_(by)
            print(f"drift: added {by} to every weight at step {at}", file=sys.stderr, flush=True)

    SpanTrainer.apply_step = apply_step  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drift-at", type=int, required=True, help="the step after which its weights go wrong")
    p.add_argument("--drift-by", type=float, default=0.5, help="added to every weight")
    args, serve_argv = p.parse_known_args(argv)
    from swarm.serve import main as serve

    install(args.drift_at, args.drift_by)
    return serve(serve_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
