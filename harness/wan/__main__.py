"""``python -m harness.wan``: ``up`` runs a WAN in the foreground until SIGINT/SIGTERM, ``down`` removes what a crashed
``up`` left (from its state file), ``measure`` starts a WAN, reports a path's RTT and throughput, and removes it.
``--nat`` puts nodes behind emulated home routers or carrier NATs (``harness.wan.nat``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from harness.wan.config import NatConfig, WanConfig
from harness.wan.emulator import Wan
from harness.wan.measure import measure_rtt, throughput
from harness.wan.netns import State, WanError, tear_down


def _pairs(text: str) -> dict[str, float]:
    """``a,b=30;c,d=5`` (or repeated options) into a mapping; keys are ``a,b`` pairs or node names."""
    out: dict[str, float] = {}
    for item in filter(None, text.split(";")):
        key, _, value = item.partition("=")
        out[key.strip()] = float(value)
    return out


def _config(args: argparse.Namespace) -> WanConfig:
    fields: dict[str, Any] = dict(
        nodes=tuple(n for n in args.nodes.split(",") if n),
        delay_ms=args.delay_ms,
        mbit=args.mbit,
        jitter_ms=args.jitter_ms,
        loss=args.loss,
        queue_ms=args.queue_ms,
        subnet=args.subnet,
        seed=args.seed,
    )
    if args.pair_delay:
        fields["pair_delay_ms"] = {k: v for text in args.pair_delay for k, v in _pairs(text).items()}
    if args.node_mbit:
        fields["node_mbit"] = {k: v for text in args.node_mbit for k, v in _pairs(text).items()}
    if args.prefix:
        fields["prefix"] = args.prefix
    if args.nat:
        fields["nats"] = tuple(_nat(text) for text in args.nat)
    return WanConfig(**fields)


def _nat(text: str) -> NatConfig:
    """``home=port-restricted:a,b`` (a NAT named home of that kind in front of nodes a and b), with ``@30`` for a
    30 s mapping timeout; the inside may name other NATs: ``cgn=symmetric:home`` puts home behind a carrier NAT."""
    name, _, rest = text.partition("=")
    kind, _, inside = rest.partition(":")
    inside, _, timeout = inside.partition("@")
    extra: dict[str, Any] = {"timeout_s": float(timeout)} if timeout else {}
    return NatConfig(name=name.strip(), kind=kind.strip(), inside=tuple(i for i in inside.split(",") if i), **extra)


def describe(wan: Wan) -> dict[str, Any]:
    """What a user of a running WAN needs: each node's namespace and address, and the router's PID."""
    cfg = wan.config
    return {
        "prefix": cfg.prefix,
        "router_pid": wan.router_pid,
        "nodes": {
            n: {"namespace": cfg.namespace(n), "address": cfg.address(n), "public_address": cfg.public_address(n)}
            for n in cfg.nodes
        },
        "nats": {n.name: {"kind": n.kind, "address": cfg.nat_address(n.name), "inside": n.inside} for n in cfg.nats},
        "delay_ms": cfg.delay_ms,
        "mbit": cfg.mbit,
    }


def _stop_on_signals() -> None:
    """SIGINT/SIGTERM end ``up`` through the ``with`` block's cleanup; further signals are ignored meanwhile, so a
    second Ctrl-C cannot cut the cleanup short and leave namespaces behind."""

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def up(args: argparse.Namespace) -> int:
    _stop_on_signals()
    with Wan(_config(args), state_file=args.state) as wan:
        print(json.dumps(describe(wan)), flush=True)
        print(
            f"WAN up; run commands with `ip netns exec {wan.config.prefix}-NODE ...`; Ctrl-C removes it",
            file=sys.stderr,
            flush=True,
        )
        assert wan.router is not None
        while wan.router.poll() is None:
            time.sleep(0.5)
        print(f"the WAN router exited with {wan.router.returncode}; removing the WAN", file=sys.stderr)
        return 1


def down(args: argparse.Namespace) -> int:
    path = Path(args.state)
    if not path.exists():
        print(f"no state file {path}: nothing to remove", file=sys.stderr)
        return 0
    state = State.load(path)
    gone = tear_down(state)
    path.unlink()
    print(json.dumps({"prefix": state.prefix, "deleted_namespaces": gone}))
    return 0


def measure(args: argparse.Namespace) -> int:
    _stop_on_signals()
    cfg = _config(args)
    a, b = args.path.split(",") if args.path else cfg.nodes[:2]
    with Wan(cfg, state_file=args.state) as wan:
        rtt = measure_rtt(wan, a, b)
        report = throughput(wan, a, b, int(args.mbytes * (1 << 20)))
    print(
        json.dumps(
            {
                "path": [a, b],
                "configured_rtt_ms": 2 * cfg.delay_between(a, b),
                "rtt_ms": round(rtt, 2),
                "configured_mbit": min((m for m in (cfg.mbit_of(a), cfg.mbit_of(b)) if m is not None), default=None),
                "steady_mbit": round(report["steady_mbit"], 2),
                "whole_transfer_mbit": round(report["mbit"], 2),
                "router": wan.counters,
            }
        )
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.wan", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("up", "start a WAN; stays in the foreground until SIGINT/SIGTERM"),
        ("measure", "start a WAN, measure a path, remove it"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--nodes", required=True, help="comma-separated node names, e.g. a,b,c")
        s.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay between any two nodes")
        s.add_argument("--pair-delay", action="append", help="per-pair one-way delay, e.g. 'a,b=50' (repeatable)")
        s.add_argument("--mbit", type=float, default=None, help="each node's bandwidth each way (default unlimited)")
        s.add_argument("--node-mbit", action="append", help="per-node bandwidth, e.g. 'a=10' (repeatable)")
        s.add_argument("--jitter-ms", type=float, default=0.0, help="each packet's delay varies within ±this")
        s.add_argument("--loss", type=float, default=0.0, help="fraction of segments dropped at random")
        s.add_argument("--queue-ms", type=float, default=None, help="links' drop-tail queue (default: one RTT)")
        s.add_argument("--prefix", default=None, help="prefix of created names (default: random)")
        s.add_argument("--subnet", default="10.77.0.0/16")
        s.add_argument("--seed", type=int, default=None, help="seed of jitter and loss")
        s.add_argument("--state", default=None, help="state file, for `down` after a crash")
        s.add_argument(
            "--nat",
            action="append",
            help="a NAT in front of nodes or NATs: 'home=port-restricted:a,b@60' (kinds: full-cone, "
            "restricted-cone, port-restricted, symmetric, firewall (stateful, no translation); repeatable, "
            "'cgn=symmetric:home' for a double NAT)",
        )
    sub.choices["measure"].add_argument("--path", default=None, help="'a,b': measure from a to b (default: first two)")
    sub.choices["measure"].add_argument("--mbytes", type=float, default=16.0, help="throughput transfer size (MiB)")
    d = sub.add_parser("down", help="remove what a crashed `up` left, by its state file")
    d.add_argument("--state", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "up":
            return up(args)
        if args.command == "down":
            return down(args)
        return measure(args)
    except WanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
