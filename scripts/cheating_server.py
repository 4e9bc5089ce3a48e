"""A cheating server: a real ``swarm.serve`` peer whose blocks compute wrong answers (and commit to them), for testing
and measuring verification. The cheats themselves are ``harness/cheats.py`` (its doc lists the modes).

    python scripts/cheating_server.py MODE [--fraction F] [--seed S] [--scale X] -- [swarm.serve arguments...]
    python scripts/cheating_server.py noise --fraction 0.1 --seed 3 -- --model smollm2-135m --blocks 10:20 \\
        --initial-peers /ip4/127.0.0.1/tcp/.../p2p/...

MODE: ``honest`` (no change), ``noise``, ``quant4``, ``swap``, ``last``, ``int8``, ``nf4``. Tests and benchmarks
start one inside a ``LocalSwarm`` with ``start_cheater``
(``tests.helpers.scripts.load_script("cheating_server").start_cheater``): it announces itself ten times faster than the
tiny test models' servers (``--throughput 1000``, forward tokens/s of one block; a benchmark of a bigger model names
more), so clients route to it first. Importing this file costs only the standard
library and ``swarm.launch``."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``swarm``, ``peers`` and ``harness``
    sys.path.insert(0, str(ROOT))

from swarm.launch import LocalSwarm, PeerProcess  # noqa: E402

MODES = (
    "honest",
    "noise",
    "quant4",
    "swap",
    "last",
    "int8",
    "nf4",
)  # harness.cheats.MODES (not imported here: it pulls in torch)
CHEATS = "harness.cheats"  # the module a forked cheater runs the ``main`` of


def start_cheater(
    swarm: LocalSwarm,
    mode: str,
    span: str | None,
    *,
    fraction: float = 1.0,
    seed: int = 0,
    wait: bool = True,
    scale: float = 1e-2,
    throughput: float = 1000.0,
) -> PeerProcess:
    """A cheater serving ``span`` in ``swarm`` (None: what the broker places it on), started as ``LocalSwarm``
    starts its peers (forked from the swarm's fork server when it has one, else a process of its own) and stopped
    with them."""
    from harness.fork_server import ForkServer

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is none of {MODES}")
    argv = [mode, "--fraction", repr(fraction), "--seed", str(seed), "--scale", repr(scale), "--"]
    argv += ["--model", swarm.model, *swarm.extra_args, "--throughput", repr(throughput)]
    argv += ["--initial-peers", *swarm.initial_peers]
    argv += [*(["--blocks", span] if span is not None else []), *(["--test-timings"] if swarm.test_timings else [])]
    swarm.log_dir.mkdir(parents=True, exist_ok=True)
    where = span.replace(":", "_") if span is not None else "placed"
    log_path = swarm.log_dir / f"cheater-{len(swarm.peers)}-{mode}-{where}.log"
    if isinstance(swarm.spawner, ForkServer) and not swarm.env_overrides:
        log_path.write_text("")
        proc = swarm.spawner.spawn(argv, log_path, main=CHEATS)
        peer = PeerProcess(proc, span, (mode,), log_path)
    else:
        with open(log_path, "w") as stderr:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *argv],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=swarm.env,
            )
        peer = PeerProcess(popen, span, (mode,), log_path)
    threading.Thread(target=peer._watch_stdout, daemon=True).start()
    swarm.peers.append(peer)
    if wait:
        peer.wait_ready(swarm.startup_timeout)
    return peer


if __name__ == "__main__":
    from harness.cheats import main

    sys.exit(main(sys.argv[1:]))
