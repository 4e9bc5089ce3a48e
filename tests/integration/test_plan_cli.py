"""``python -m swarm.plan`` over a real swarm on 127.0.0.1: it routes as a client would, prints the plan with the
servers it chose, draws it through Graphviz, leaves no DHT process behind, and ``--check`` refuses a tampered plan
file with exit code 2 and the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.plan.ir import Plan
from tests.helpers.swarms import descendants, running_swarm, survivors

ROOT = Path(__file__).resolve().parents[2]


def run_plan(*args: str, tmp_path: Path, timeout: float = 180.0) -> tuple[int, str, str, set[int]]:
    """Run the command to its end, noting every process it started on the way (its DHT child and p2pd)."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "swarm.plan", *args], cwd=ROOT, stdout=stdout, stderr=stderr)
    family: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            family |= set(descendants(proc.pid))
            time.sleep(0.1)
        code = proc.wait(max(deadline - time.monotonic(), 1.0))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return code, out.read_text(), err.read_text(), family


@pytest.mark.slow  # 30 s on 2 cores: two servers, then the command's DHT peer and Graphviz
def test_plan_of_a_finetuning_step_over_a_live_swarm(tiny_models, tmp_path):
    folder = str(tiny_models["llama"])
    png, svg, plan_json = tmp_path / "plan.png", tmp_path / "plan.svg", tmp_path / "plan.json"
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        servers = [p.peer_id for p in swarm.peers]
        code, out, err, family = run_plan(
            "--initial-peers",
            *swarm.initial_peers,
            "--model",
            folder,
            "--task",
            "finetune",
            "--tokens",
            "16",
            "--png",
            str(png),
            "--svg",
            str(svg),
            "--json",
            str(plan_json),
            "--log-format",
            "json",
            tmp_path=tmp_path,
        )
    assert code == 0, err
    assert len(family) >= 2  # it did start a DHT child and its p2pd ...
    assert survivors(family) == []  # ... and left none of them running
    # it logs JSON: asyncio's complaints would be records of its logger, a traceback at exit lines that are not JSON
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert not [r for r in records if r["logger"].startswith("asyncio") or r["level"] in ("ERROR", "CRITICAL")]

    assert out.startswith("finetune plan of tiny-llama: 4 blocks, hidden 64, vocab 320")
    for peer, span in zip(servers, ("0:2", "2:4"), strict=True):  # the route went through both servers, in order
        assert f"  {peer}  blocks {span} (torch, float32)" in out
    assert "b1           backward  span_backward   .." in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and svg.read_text().rstrip().endswith("</svg>")
    plan = Plan.parse(plan_json.read_bytes())
    assert plan.task == "finetune" and [(n.peer, n.start, n.end) for n in plan.remote() if n.op == "span_forward"] == [
        (servers[0], 0, 2),
        (servers[1], 2, 4),
    ]
    assert str(plan.types()["f0.in"]) == "float32[1, 16, 64]"

    # the file read back prints the same table
    check = subprocess.run(
        [sys.executable, "-m", "swarm.plan", "--check", str(plan_json)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and out.startswith(check.stdout.rstrip()), check.stderr

    # a tampered file: a transfer that claims to carry less than it does
    d = json.loads(plan_json.read_text())
    next(n for n in d["nodes"] if n["id"] == "f1.in")["nbytes"] = 64
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(d))
    check = subprocess.run(
        [sys.executable, "-m", "swarm.plan", "--check", str(tampered)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 2 and check.stdout == ""
    assert check.stderr.strip() == (
        f"error: {tampered} is not a valid plan: node f1.in: 64 bytes declared for float32[1, 16, 64] (4096 bytes)"
    )


def test_usage_errors_name_the_problem():
    none = subprocess.run(
        [sys.executable, "-m", "swarm.plan", "--task", "forward"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert none.returncode == 2 and "give --initial-peers MADDR ... (or --check FILE)" in none.stderr
    wrong = subprocess.run(
        [sys.executable, "-m", "swarm.plan", "--check", "x.json", "--png", "x.svg"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "the file name must end in .png" in wrong.stderr


@pytest.mark.slow  # a process each (tests/unit/test_plan_ir.py refuses the same bytes in-process)
@pytest.mark.parametrize("payload", [b"\x00garbage", b'{"task": "forward"}'])
def test_check_refuses_what_is_not_a_plan(tmp_path, payload):
    bad = tmp_path / "bad.plan"
    bad.write_bytes(payload)
    check = subprocess.run(
        [sys.executable, "-m", "swarm.plan", "--check", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 2 and check.stderr.startswith(f"error: {bad} is not a valid plan: "), check.stderr
