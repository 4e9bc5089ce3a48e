"""The README's five-minute tour, run as a user types it: every command of its code blocks, from the checkout, with
the project's venv first on ``PATH`` (as after ``source .venv/bin/activate``), in the README's order, against the
swarm its first command starts. Only what the user fills in is replaced: ``MADDR`` and the Python example's
``/ip4/.../p2p/...`` by the address the first peer printed, port 8000 by a free port, ``$KEY`` by a key. The tour
names SmolLM2 by its Hub name, fetched from a local server of the Hub's file API (``HF_ENDPOINT``) that serves the
session's fresh conversion of it (``SWARM_CACHE_DIR``). Servers are stopped as a user stops them (SIGTERM,
Ctrl-C for ``local_swarm.py``) and must exit cleanly, leaving no process behind."""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_hub import FakeHub

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow
KEY = "tour-key-0123456789"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the tour's model


def tour() -> list[tuple[str, str]]:
    """(language, command) for every command in the tour's code blocks: continuation lines joined, comments cut."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    found = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        if lang == "python":
            found.append((lang, body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                found.append((lang, command))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tour:
    def __init__(self, tmp: Path) -> None:
        self.marker = uuid.uuid4().hex  # in every process the tour starts (inherited), to find any left behind
        bin_dir = str(Path(sys.executable).parent)
        self.env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", KEY=KEY, SWARM_TOUR=self.marker)
        self.tmp, self.maddr, self.port = tmp, "", free_port()
        self.running: list[subprocess.Popen[str]] = []
        self.stderr = ""  # of the last command run to its end

    def fill(self, command: str) -> str:
        return command.replace("MADDR", self.maddr).replace("8000", str(self.port))

    def start(self, command: str) -> subprocess.Popen[str]:
        log = open(self.tmp / f"{len(self.running)}.log", "w")
        proc = subprocess.Popen(
            ["bash", "-c", "exec " + self.fill(command)],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        self.running.append(proc)
        return proc

    def run(self, command: str, timeout: float = 180) -> str:
        done = subprocess.run(
            ["bash", "-c", self.fill(command)], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        self.stderr = done.stderr
        return done.stdout

    def line(self, proc: subprocess.Popen[str], prefix: str, timeout: float = 300) -> str:
        """The first line of ``proc``'s stdout that starts with ``prefix``."""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                text = proc.stdout.readline()
                if text.startswith(prefix):
                    return text[len(prefix) :].strip()
                if text:
                    continue
            assert proc.poll() is None, f"exited {proc.returncode}: {self.logs()}"
        raise AssertionError(f"no {prefix!r} line in {timeout} s: {self.logs()}")

    def api_up(self, timeout: float = 120) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"the API did not answer on port {self.port}: {self.logs()}")

    def stop(self, proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
        os.kill(proc.pid, sig)
        assert proc.wait(60) == 0, self.logs()
        self.running.remove(proc)

    def logs(self) -> str:
        return "\n".join(f"---- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def left(self) -> list[int]:
        """Processes still running that the tour started (any depth: they carry its marker)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and f"SWARM_TOUR={self.marker}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def close(self) -> None:
        for proc in self.running:
            proc.kill()
            proc.wait(30)
        for pid in self.left():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def hub(smollm_folder: Path) -> Iterator[FakeHub]:
    """The Hub the tour's name is fetched from: a local server of the Hub's file API serving the session's SmolLM2
    conversion (no Hub is reachable here) under the tour's Hub name."""
    with FakeHub() as server:
        server.add(HUB_NAME, smollm_folder)
        yield server


@pytest.fixture
def walk(tmp_path: Path, hub: FakeHub) -> Iterator[Tour]:
    t = Tour(tmp_path)
    t.env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf-cache"))
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        t.env.pop(var, None)
    try:
        yield t
    finally:
        t.close()


def test_every_command_of_the_readme_tour_runs_as_typed(walk: Tour, hub: FakeHub, smollm_folder: Path) -> None:
    steps = tour()
    assert len(steps) == 7, f"the tour changed; walk its new commands here too: {steps}"
    new_swarm, join, status, example, api, local_swarm, curl = (command for _, command in steps)
    assert "--new-swarm" in new_swarm and "--initial-peers MADDR" in join and "swarm.status" in status
    assert "swarm.api" in api and "scripts/local_swarm.py" in local_swarm and curl.startswith("curl ")

    first = walk.start(new_swarm)
    walk.maddr = walk.line(first, "initial_peers: ")
    second = walk.start(join)
    walk.line(second, "initial_peers: ")
    deadline = time.monotonic() + 180  # the broker places the second peer where blocks are missing
    while "fully covered" not in (shown := walk.run(status)):
        assert time.monotonic() < deadline, shown
        time.sleep(2)

    code = example.replace('["/ip4/.../p2p/..."]', repr([walk.maddr]))
    answer = walk.run(f"python -c {shlex.quote(code)}")
    assert "Paris" in answer and "Hop(" in answer, answer
    assert "Task was destroyed" not in walk.stderr, walk.stderr  # a model left open closes at exit, quietly

    server = walk.start(api)
    walk.api_up()
    reply = walk.run(curl)
    assert '"content"' in reply and reply.rstrip().endswith("data: [DONE]"), reply
    for proc in (server, second, first):
        walk.stop(proc)

    local = walk.start(local_swarm)
    walk.api_up(timeout=300)
    reply = walk.run(curl)
    assert '"content"' in reply and reply.rstrip().endswith("data: [DONE]"), reply
    walk.stop(local, signal.SIGINT)  # Ctrl-C
    deadline = time.monotonic() + 30
    while walk.left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not walk.left(), f"processes left behind: {walk.left()}"
    sent = {path: n for path, n in hub.sent_for(HUB_NAME).items() if path.endswith(".safetensors")}
    assert sent, "the tour fetched no weights by the Hub name"
    for path, n in sent.items():  # one shared cache: each shard crossed the network once, whoever read it first
        assert n == (smollm_folder / path).stat().st_size, (path, n)
