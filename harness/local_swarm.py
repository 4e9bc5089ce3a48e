"""What tests and benchmarks add to a local swarm (``swarm.launch.LocalSwarm``): the HTTP API in a child process
(``ApiProcess``) and failure drills that kill, freeze or stop the servers a client is using (``Disturber``). Every
process is stopped by the PID this object started, never by name."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from harness.env import child_env
from swarm.hop import Hop
from swarm.launch import LocalSwarm, PeerProcess

log = logging.getLogger(__name__)


class ApiProcess:
    """``python -m swarm.api`` over a running swarm, in a child process (stopped by its PID): its ``url`` is read
    from the ``api: URL`` line it prints once it listens."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        *args: str,
        test_timings: bool = True,
        log_path: Path | None = None,
        startup_timeout: float = 120.0,
        prefix: Sequence[str] = (),
    ) -> None:
        """``prefix``: run the API under this command, e.g. ``Wan.argv(node, [])`` to put it in a WAN node (it must
        exec the API, so the PID stays the API's own)."""
        cmd = [*prefix, sys.executable, "-m", "swarm.api", "--port", "0", *args, "--initial-peers", *initial_peers]
        if test_timings:
            cmd.append("--test-timings")
        # a log folder of its own is removed with the API (``__exit__``); one given is the caller's
        self._own_dir: Path | None = None
        if log_path is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix="swarm-api-"))
            log_path = self._own_dir / "api.log"
        self.log_path = log_path
        with open(self.log_path, "w") as stderr:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env({"PYTHONUNBUFFERED": "1"})
            )
        self.url = ""
        try:
            self.url = self._wait(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("api: ") and not found:
                    found.append(line.split(" ", 1)[1].strip())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while not found and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not found:
            raise RuntimeError(
                f"the API did not start (exit code {self.proc.poll()}):\n{self.log_path.read_text()[-3000:]}"
            )
        return found[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> ApiProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


class _Routed(Protocol):
    @property
    def route(self) -> Sequence[Hop]: ...


class Disturber:
    """A Hugging Face streamer for failure drills: after token k of ``plan`` ({token: hop index}) it sends ``sig``
    to the server on that hop of the model's current route (SIGKILL, SIGSTOP to freeze, SIGTERM to make it leave),
    and it timestamps every token so stalls can be measured."""

    def __init__(self, model: _Routed, swarm: LocalSwarm, plan: dict[int, int], sig: int = signal.SIGKILL) -> None:
        self.model, self.swarm, self.plan, self.sig = model, swarm, plan, sig
        self.count = -1  # generate's first put() is the prompt
        self.times: list[float] = []
        self.events: list[float] = []
        self.victims: list[PeerProcess] = []

    @property
    def killed(self) -> list[str]:
        return [p.peer_id for p in self.victims]

    def put(self, value: object) -> None:
        self.count += 1
        self.times.append(time.perf_counter())
        if self.count in self.plan:
            peer = self.swarm.peer_by_id(self.model.route[self.plan[self.count]].peer_id)
            self.victims.append(peer)
            if self.sig == signal.SIGKILL:
                self.swarm.kill(peer)
            else:
                peer.proc.send_signal(self.sig)
            self.events.append(time.perf_counter())

    def end(self) -> None:
        pass

    def stalls(self) -> list[float]:
        """Seconds from each disturbance to the next token."""
        return [next(t for t in self.times if t > e) - e for e in self.events]
