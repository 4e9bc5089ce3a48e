"""Start and stop real peers (``python -m swarm.serve`` processes) on 127.0.0.1: used by the demo, the benchmarks and
the integration tests. Every process is stopped by the PID this object started, never by name."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from swarm.fork_server import ForkedPeer, ForkServer
from swarm.rpc.hop import Hop

log = logging.getLogger(__name__)


@dataclass
class PeerProcess:
    proc: subprocess.Popen[str] | ForkedPeer
    span: str | None
    args: tuple[str, ...]
    log_path: Path
    maddr: str | None = None
    urls: dict[str, str] = field(default_factory=dict)  # "metrics", "dashboard": where a port 0 ended up
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def peer_id(self) -> str:
        if self.maddr is None:
            raise RuntimeError(f"peer {self.span} has not started")
        return self.maddr.split("/p2p/")[1]

    def _watch_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("initial_peers: "):
                self.maddr = line.split(" ", 1)[1].strip()
                self._ready.set()
            elif line.startswith(("metrics: ", "dashboard: ")):  # printed before initial_peers (peers.observe)
                name, url = line.split(": ", 1)
                self.urls[name] = url.strip()
        self._ready.set()  # exited: wake the waiter, which sees maddr is None

    def wait_ready(self, timeout: float) -> str:
        if not self._ready.wait(timeout) or self.maddr is None:
            tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(f"peer {self.span} did not start (exit code {self.proc.poll()}):\n{tail}")
        return self.maddr


class LocalSwarm:
    def __init__(
        self,
        model: str,
        spans: list[str | None],
        *,
        extra_args: tuple[str, ...] = (),
        test_timings: bool = False,
        log_dir: Path | None = None,
        startup_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        spawner: ForkServer | None = None,
    ) -> None:
        """``spawner``: fork peers from this fork server (the tests') instead of starting each with ``subprocess``."""
        self.model = model
        self.spans = spans
        self.extra_args = extra_args
        self.test_timings = test_timings
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="swarm-peers-"))
        self.startup_timeout = startup_timeout
        self.env = dict(os.environ, **(env or {}))
        self.env_overrides = dict(env or {})  # a fork server's peers get its own environment: none of these
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.peers: list[PeerProcess] = []
        self.spawner = spawner

    @property
    def initial_peers(self) -> list[str]:
        return [p.maddr for p in self.peers if p.maddr and p.proc.poll() is None]

    def _spawn(self, span: str | None, args: tuple[str, ...]) -> PeerProcess:
        argv = ["--model", self.model, *self.extra_args, *args]  # peer args win
        if span:
            argv += ["--blocks", span]
        if self.test_timings:
            argv.append("--test-timings")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"peer-{len(self.peers)}-{(span or 'auto').replace(':', '_')}.log"
        proc: subprocess.Popen[str] | ForkedPeer
        if self.spawner is not None and not self.env_overrides:
            log_path.write_text("")
            proc = self.spawner.spawn(argv, log_path)
        else:
            with open(log_path, "w") as stderr:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen(
                    [sys.executable, "-m", "swarm.serve", *argv],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=self.env,
                )
        peer = PeerProcess(proc, span, tuple(args), log_path)
        threading.Thread(target=peer._watch_stdout, daemon=True).start()
        self.peers.append(peer)
        return peer

    def start(self) -> LocalSwarm:
        try:
            first = self._spawn(self.spans[0], ("--new-swarm",))
            first.wait_ready(self.startup_timeout)
            rest = [self.add_peer(span, wait=False) for span in self.spans[1:]]
            for peer in rest:
                peer.wait_ready(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def add_peer(self, span: str | None, *extra: str, wait: bool = True) -> PeerProcess:
        peer = self._spawn(span, ("--initial-peers", *self.initial_peers, *extra))
        if wait:
            peer.wait_ready(self.startup_timeout)
        return peer

    def peer_by_id(self, peer_id: str) -> PeerProcess:
        return next(p for p in self.peers if p.maddr and p.maddr.endswith("/p2p/" + peer_id))

    def kill(self, peer: PeerProcess, sig: int = signal.SIGKILL) -> None:
        if peer.proc.poll() is None:
            os.kill(peer.pid, sig)
            if sig == signal.SIGKILL:
                peer.proc.wait(30)

    def stop(self) -> None:
        for peer in self.peers:
            if peer.proc.poll() is None:
                try:
                    os.kill(peer.pid, signal.SIGCONT)  # a frozen peer cannot handle SIGTERM
                    peer.proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for peer in self.peers:
            try:
                peer.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("peer %s ignored SIGTERM; killing it", peer.pid)
                peer.proc.kill()
                peer.proc.wait(10)
            if peer.proc.stdout:
                peer.proc.stdout.close()

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    ) -> None:
        cmd = [sys.executable, "-m", "swarm.api", "--port", "0", *args, "--initial-peers", *initial_peers]
        if test_timings:
            cmd.append("--test-timings")
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="swarm-api-")) / "api.log"
        with open(self.log_path, "w") as stderr:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
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
