"""``swarm/`` never imports ``peers/`` (except the lazy import in the serve entry point), and importing the client
package does no heavy work."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_swarm_does_not_import_peers():
    offenders = []
    for path in (ROOT / "swarm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "peers" or n.startswith("peers.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert all(o.startswith("swarm/serve.py:") for o in offenders), offenders


def test_import_swarm_is_cheap():
    code = "import sys, swarm; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
