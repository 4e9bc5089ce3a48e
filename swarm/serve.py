"""``python -m swarm.serve``: start a volunteer peer that serves a span of a model's blocks."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from swarm.config import PeerConfig, Timing, default_cache_dir
from swarm.errors import run_command
from swarm.ids import parse_span
from swarm.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.serve", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="a name from configs/models or a Hugging Face folder")
    p.add_argument(
        "--blocks",
        type=parse_span,
        help="pin this peer to span START:END (default: serve what the swarm's broker assigns)",
    )
    p.add_argument("--max-blocks", type=int, help="most blocks to hold (default: as many as memory allows)")
    p.add_argument("--no-broker", action="store_true", help="never take the broker role")
    p.add_argument(
        "--network-mbps",
        type=float,
        help="this peer's link bandwidth in Mbit/s, for the broker's placement (default: unknown)",
    )
    p.add_argument("--replication", type=int, default=1, help="broker policy: serving peers per block")
    p.add_argument(
        "--standby-fraction", type=float, default=0.1, help="broker policy: share of peers kept as warm standbys"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--new-swarm", action="store_true", help="start a new swarm")
    g.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs of running peers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0 = any free port)")
    p.add_argument(
        "--direct-port",
        default="0",
        help="plain-TCP data plane port (0 = any free port, 'off' = libp2p only); see swarm/direct.py",
    )
    p.add_argument("--announce-maddr", nargs="+", default=[], help="address(es) others should dial")
    p.add_argument("--identity", type=Path, help="identity file (stable peer id + record key); created if missing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", help="serving dtype (default: the model card's)")
    p.add_argument("--cache-tokens", type=int, default=8192, help="KV-cache budget in tokens (batch x length)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="largest batch x seq of one request")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--max-adapter-mb", type=float, default=512, help="room for clients' LoRA adapters / deep prompts, all together"
    )
    p.add_argument(
        "--throughput",
        default="auto",
        help="'auto' (measure once and cache) or forward tokens/s of ONE block (skips the probe)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="converted models, probes (default ~/.cache/swarm)")
    p.add_argument("--added-latency-ms", type=float, default=0.0, help="delay each request (emulate distance)")
    p.add_argument("--test-timings", action="store_true", help="short record TTLs and timeouts, for tests")
    p.add_argument("--perturb-weights", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--train", type=Path, help="serve a trainable stage of this pre-training run (a run TOML file)")
    p.add_argument("--checkpoint-dir", type=Path, help="where a trainable stage checkpoints (default: the run's)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        model=args.model,
        blocks=args.blocks,
        initial_peers=tuple(args.initial_peers),
        new_swarm=args.new_swarm,
        host=args.host,
        port=args.port,
        announce_maddrs=tuple(args.announce_maddr),
        direct_port=None if args.direct_port == "off" else int(args.direct_port),
        max_blocks=args.max_blocks,
        network_mbps=args.network_mbps,
        broker=not args.no_broker,
        replication=args.replication,
        standby_fraction=args.standby_fraction,
        identity=args.identity,
        device=args.device,
        dtype=args.dtype,
        cache_tokens=args.cache_tokens,
        max_batch_tokens=args.max_batch_tokens,
        max_adapter_bytes=int(args.max_adapter_mb * 1024 * 1024),
        threads=args.threads,
        throughput=None if args.throughput == "auto" else float(args.throughput),
        cache_dir=args.cache_dir or default_cache_dir(),
        timing=Timing.for_tests() if args.test_timings else Timing(),
        added_latency_ms=args.added_latency_ms,
        perturb_weights=args.perturb_weights,
        train=args.train,
        checkpoint_dir=args.checkpoint_dir,
    )


async def _main(cfg: PeerConfig) -> None:
    from peers.node import run_peer  # the one place swarm/ reaches into peers/

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(maddrs: list[str]) -> None:
        print(f"initial_peers: {maddrs[0]}", flush=True)

    await run_peer(cfg, stop, ready)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return run_command(lambda: asyncio.run(_main(config_from_args(args))))


if __name__ == "__main__":
    sys.exit(main())
