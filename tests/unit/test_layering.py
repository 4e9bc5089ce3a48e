"""The layering: ``swarm/`` never imports ``peers/`` (except the serve entry point, which wires the node); nothing in
``peers/`` and no shared module of ``swarm/`` imports the client (``swarm.client``): peer-to-peer calls live in
``swarm.rpc``, shared by both sides, and only entry points wire the client in. Importing ``swarm`` does no heavy
work."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# swarm/wan/client_job.py: the client process of a WAN node (benchmarks and the WAN test); swarm/perf/probe.py: the
# calibration's swarm with a client (run by ``python -m swarm.perf calibrate``)
ENTRY_POINTS = {
    "swarm/serve.py",
    "swarm/status.py",
    "swarm/demo.py",
    "swarm/train.py",
    "swarm/export.py",
    "swarm/plan/__main__.py",
    "swarm/wan/client_job.py",
    "swarm/perf/probe.py",
}
PUBLIC_API = "swarm/__init__.py"  # re-exports the client lazily
# the client itself, and the HTTP API (``python -m swarm.api``): an application of the client, as the demo is
CLIENT_SIDE = ("swarm/client/", "swarm/api/")


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def offenders(folder: str, forbidden: str, allowed: set[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed or rel.startswith(CLIENT_SIDE):
            continue
        found += [
            f"{rel}:{line} imports {name}"
            for line, name in imports(path)
            if name == forbidden or name.startswith(forbidden + ".")
        ]
    return found


def test_swarm_does_not_import_peers():
    assert offenders("swarm", "peers", {"swarm/serve.py"}) == []


def test_nothing_outside_the_client_and_entry_points_imports_the_client():
    assert offenders("peers", "swarm.client", set()) == []
    assert offenders("swarm", "swarm.client", ENTRY_POINTS | {PUBLIC_API}) == []


def test_import_swarm_is_cheap():
    code = "import sys, swarm; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
