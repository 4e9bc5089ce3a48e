"""The fork server leaves nothing behind: when the test process that owns it dies without stopping its peers, or the
fork server itself is killed, its children stop too (a leaked peer keeps its p2pd running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.env import child_env
from harness.fork_server import ForkServer

IDLER = "tests.helpers.idler"
GONE_WITHIN_S = 60.0  # generous: the grace a peer's clean shutdown gets, on 2 busy cores


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie nobody reaped has stopped


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _wait_line(path: Path, text: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.1)


OWNER = """
import sys, time
from pathlib import Path
from harness.fork_server import ForkServer
server = ForkServer()
child = server.spawn([], Path(sys.argv[1]), main="tests.helpers.idler")
print(child.pid, flush=True)
time.sleep(600)
"""


def test_children_stop_when_the_owner_dies(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "idler.log")],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env({}),
        cwd=Path(__file__).parents[2],
    )
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        _wait_line(tmp_path / "idler.out", "idle")
        assert _alive(pid)
    finally:
        owner.kill()  # no close(), no stopping its peers: as a test process that crashed
        owner.wait()
    assert _wait_gone(pid), f"the fork server's child {pid} outlived the process that owned it"


def test_children_stop_when_the_fork_server_is_killed(tmp_path: Path) -> None:
    server = ForkServer()
    child = server.spawn([], tmp_path / "idler.log", main=IDLER)
    try:
        _wait_line(tmp_path / "idler.out", "idle")
        server._proc.kill()
        server._proc.wait()
        assert _wait_gone(child.pid), f"the child {child.pid} outlived its killed fork server"
    finally:
        if _alive(child.pid):
            os.kill(child.pid, signal.SIGKILL)
        server.close()


def test_a_child_killed_holding_hivemind_locks_blocks_no_other(tmp_path: Path) -> None:
    """hivemind makes its process-wide locks at import, in the fork server: a peer SIGKILLed while it held one (an
    MPFuture update takes it) must not leave it taken for every other peer (their DHT calls and starts hang on it)."""
    server = ForkServer()
    try:
        holder = server.spawn(["hold"], tmp_path / "holder.log", main="tests.helpers.lock_probe")
        _wait_line(tmp_path / "holder.out", "holding")
        os.kill(holder.pid, signal.SIGKILL)
        assert _wait_gone(holder.pid)
        taker = server.spawn(["take"], tmp_path / "taker.log", main="tests.helpers.lock_probe")
        _wait_line(tmp_path / "taker.out", "\n")
        assert (tmp_path / "taker.out").read_text().strip() == "took every lock"
        assert taker.wait(GONE_WITHIN_S) == 0
    finally:
        server.close()
