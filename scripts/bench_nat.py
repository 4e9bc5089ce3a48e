"""Volunteers behind home routers, measured: ``python scripts/bench_nat.py [--delay-ms 25] [--tokens 24]``.

For each kind of NAT in front of a server (none, full-cone, port-restricted, symmetric, and a port-restricted home
router behind a carrier's port-restricted NAT), a WAN-emulated swarm of the tiny Llama card (8 blocks): a public
relay (``--relay``) serving blocks 0:4, the server behind that NAT serving 4:8, and a client behind a port-
restricted NAT of its own, every link ``--delay-ms`` one way. It prints, per kind: how long the server took from
start to ready (it holds its relay slot and has been reached through it by then), the client's chained decode step
(median over ``--tokens`` greedy tokens) and its ratio to the public server's measured in the same run, how the
client reached the server (``punched``: a direct TLS connection by hole punching; ``relayed``: libp2p through the
relay), the bytes the relay carried against the bytes of the client's own calls, and the CPU seconds the relay
process used. The generated tokens are checked equal across kinds. Needs root, /dev/net/tun and ``ip`` (the WAN
emulator)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.wan import Wan, WanConfig, unavailable_reason  # noqa: E402
from harness.wan.config import NatConfig  # noqa: E402
from harness.wan.nodes import ClientJob, WanSwarm  # noqa: E402

MODEL = "tiny-llama"  # the seeded tiny Llama card (8 blocks), as scripts/bench_wan.py
KINDS = ("public", "full-cone", "port-restricted", "symmetric", "double")
PATIENT = {"step_timeout": 60.0, "request_timeout": 60.0, "open_timeout": 60.0}


def nats_for(kind: str) -> tuple[NatConfig, ...]:
    client = NatConfig(name="nat-c", kind="port-restricted", inside=("c",))
    if kind == "public":
        return (client,)
    if kind == "double":
        return (
            client,
            NatConfig(name="home", kind="port-restricted", inside=("s",)),
            NatConfig(name="cgn", kind="port-restricted", inside=("home",)),
        )
    return (client, NatConfig(name="nat-s", kind=kind, inside=("s",)))


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process and its children that have exited, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


def relay_metrics(wan: Wan, url: str) -> dict[str, float]:
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    out = wan.run("pub", [sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    found = {}
    for name in ("swarm_peer_relay_bytes_total", "swarm_peer_relay_circuits_total"):
        match = re.search(rf"^{name} ([0-9.e+]+)$", out, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def run_kind(folder: str, kind: str, delay_ms: float, tokens: int, logs: Path) -> dict[str, Any]:
    cfg = WanConfig(nodes=("pub", "s", "c"), delay_ms=delay_ms, nats=nats_for(kind))
    server_args = ("--reachability", "public") if kind == "public" else ()  # behind a NAT: found out (auto)
    relay_args = ("--relay", "--reachability", "public", "--metrics-port", "0")
    with Wan(cfg) as wan:
        with WanSwarm(wan, folder, {"pub": "0:4"}, node_args={"pub": relay_args}, log_dir=logs / kind) as swarm:
            t0 = time.monotonic()
            swarm.add_peer("4:8", *server_args, node="s")
            joined = time.monotonic() - t0
            relay = swarm.peers[0]
            url = relay.urls["metrics"].replace("0.0.0.0", wan.address("pub"))
            before, cpu0 = relay_metrics(wan, url), cpu_seconds(relay.pid)
            spec = {
                "model": folder,
                "initial_peers": swarm.initial_peers[:1],
                "test_timings": True,
                "timing": PATIENT,
                "tasks": ["generate"],
                "modes": [{"name": kind, "chain": True, "codec": "none"}],
                "prompt": list(range(3, 11)),
                "max_new_tokens": tokens,
            }
            with ClientJob(wan, "c", spec, log_path=logs / f"client-{kind}.log") as job:
                (result,) = [r for r in job.lines(300.0) if r.get("task") == "generate"]
            after, cpu1 = relay_metrics(wan, url), cpu_seconds(relay.pid)
    relayed = after["swarm_peer_relay_bytes_total"] - before["swarm_peer_relay_bytes_total"]
    path = (
        "direct" if kind == "public" else ("punched" if any("punched:" in k for k in result["punched"]) else "relayed")
    )
    return {
        "kind": kind,
        "join_s": round(joined, 2),
        "step_ms": round(1000 * result["step_s"], 2),
        "path": path,
        "relay_bytes": int(relayed),
        "data_bytes": int(result["bytes"]),
        "relay_cpu_s": round(cpu1 - cpu0, 2),
        "tokens": result["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay of every link")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per run (the step is their median)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    args = parser.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"the WAN emulator cannot run here: {reason}")
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as tmp:
        logs = Path(tmp) / "logs"
        rows = [run_kind(MODEL, kind, args.delay_ms, args.tokens, logs) for kind in args.kinds]
    public = next((r for r in rows if r["kind"] == "public"), None)
    print(
        f"{'NAT in front of the server':<28}{'join s':>8}{'step ms':>9}{'vs public':>10}  {'path':<9}"
        f"{'relay bytes / data bytes':>26}{'relay CPU s':>12}"
    )
    for r in rows:
        ratio = f"{r['step_ms'] / public['step_ms']:.2f}x" if public else "-"
        share = f"{r['relay_bytes']:,} / {r['data_bytes']:,} ({r['relay_bytes'] / max(r['data_bytes'], 1):.1%})"
        print(
            f"{r['kind']:<28}{r['join_s']:>8.1f}{r['step_ms']:>9.1f}{ratio:>10}  {r['path']:<9}{share:>26}"
            f"{r['relay_cpu_s']:>12.2f}"
        )
    same = len({json.dumps(r["tokens"]) for r in rows}) == 1
    print(f"generated tokens equal across kinds: {same}")
    print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows]))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
