"""Start and stop peers (``python -m swarm.serve`` processes) on this machine: the demo's swarm, a user's several
peers on one box (``scripts/local_swarm.py``), the benchmarks' and tests' swarms. Every process is stopped by the
PID this object started, never by name; a peer that ignores SIGTERM is killed after a grace period.

Peers start with ``subprocess`` unless a ``Spawner`` is given (the tests fork them from a process that imported
everything once: ``harness.fork_server``)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class Lines(Protocol):
    """A started peer's standard output, read line by line."""

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class PeerHandle(Protocol):
    """What ``LocalSwarm`` uses of a started peer: the part of ``subprocess.Popen``'s interface a forked peer has."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> Lines | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


class Spawner(Protocol):
    def spawn(self, argv: Sequence[str], log_path: Path, main: str = "swarm.serve") -> PeerHandle:
        """Start ``python -m MAIN *argv`` (``swarm.serve``), its stderr going to ``log_path``."""
        ...


@dataclass
class PeerProcess:
    proc: PeerHandle
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
        return self.maddr.split("/p2p/")[-1]  # a relayed address names its relay first

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
            text = self.log_path.read_text() if self.log_path.exists() else ""
            # the head says how far it got, the tail how it ended (a traceback alone fills a tail)
            shown = text if len(text) <= 6000 else f"{text[:3000]}\n[...]\n{text[-3000:]}"
            raise RuntimeError(f"peer {self.span} did not start (exit code {self.proc.poll()}):\n{shown}")
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
        spawner: Spawner | None = None,
    ) -> None:
        """``spawner``: fork peers from this fork server (the tests') instead of starting each with ``subprocess``."""
        self.model = model
        self.spans = spans
        self.extra_args = extra_args
        self.test_timings = test_timings
        # a log folder of its own is removed when the swarm is left (``__exit__``); one given is the caller's
        self._own_logs = log_dir is None
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

    def _spawn(self, span: str | None, args: tuple[str, ...], main: str = "swarm.serve") -> PeerProcess:
        """``main``: the module it runs (``python -m MAIN``), ``swarm.serve`` or a harness module wrapping it."""
        argv = ["--model", self.model, *self.extra_args, *args]  # peer args win
        if span:
            argv += ["--blocks", span]
        if self.test_timings:
            argv.append("--test-timings")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"peer-{len(self.peers)}-{(span or 'auto').replace(':', '_')}.log"
        proc: PeerHandle
        if self.spawner is not None and not self.env_overrides:
            log_path.write_text("")
            proc = self.spawner.spawn(argv, log_path, main=main)
        else:
            with open(log_path, "w") as stderr:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen(
                    [sys.executable, "-m", main, *argv],
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

    def add_peer(self, span: str | None, *extra: str, wait: bool = True, main: str = "swarm.serve") -> PeerProcess:
        peer = self._spawn(span, ("--initial-peers", *self.initial_peers, *extra), main)
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
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
