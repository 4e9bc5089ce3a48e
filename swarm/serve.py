"""``python -m swarm.serve``: start a volunteer peer that serves a span of a model's blocks (or a trainable stage
of a pre-training run). Every flag but ``--test-timings``, ``--log-level`` and ``--log-format`` is a field of
``peers.config``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from peers.config import PeerConfig
from swarm.cli import add_flags, from_args
from swarm.config import Timing
from swarm.errors import run_command
from swarm.hub import add_token_flag, use_token
from swarm.logs import add_log_flags, configure_logging
from swarm.rpc.loop import run as run_loop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.serve", description=__doc__)
    add_flags(p, PeerConfig)
    p.add_argument("--test-timings", action="store_true", help="short record TTLs and timeouts, for tests")
    p.add_argument("--state-interval", type=float, default=None, help=argparse.SUPPRESS)  # Timing.state_interval
    p.add_argument("--session-idle", type=float, default=None, help=argparse.SUPPRESS)  # Timing.session_idle
    add_token_flag(p)
    add_log_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    cfg = from_args(PeerConfig, args)
    timing = Timing.for_tests() if args.test_timings else cfg.timing
    if args.state_interval is not None:  # tests that check the limit itself, where test timings turn it off
        timing = dataclasses.replace(timing, state_interval=args.state_interval)
    if args.session_idle is not None:  # the test timings' 5 s, too short for 24 peers on 2 cores (test_scale.py)
        timing = dataclasses.replace(timing, session_idle=args.session_idle)
    return dataclasses.replace(cfg, timing=timing)


def preload() -> None:
    """Import what ``_main`` imports on start (a fork server pays it once for all the peers it forks)."""
    import peers.blocks.serving_stage  # noqa: F401
    import peers.run  # noqa: F401
    import peers.training.trainable_stage  # noqa: F401
    import swarm.dashboard.peer  # noqa: F401


async def _main(cfg: PeerConfig) -> None:
    # the entry point wires the two sides: the node and the stage it serves
    from peers.blocks.serving_stage import ServingStage
    from peers.run import run_peer
    from peers.serving.stage_port import Stage
    from peers.training.trainable_stage import TrainableStage
    from swarm.dashboard.peer import serve_peer_dashboard

    cfg.check()
    stage: Stage = (
        TrainableStage.from_config(cfg.train, cfg.compute, cfg.cache_dir, cfg.checkpoint_dir)
        if cfg.train
        else ServingStage.from_config(cfg.model, cfg.compute, cfg.cache_dir)
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(maddrs: list[str]) -> None:
        print(f"initial_peers: {maddrs[0]}", flush=True)

    await run_peer(cfg, stage, stop, ready, serve_peer_dashboard)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    use_token(args.token)
    return run_command(lambda: run_loop(_main(config_from_args(args))))


if __name__ == "__main__":
    sys.exit(main())
