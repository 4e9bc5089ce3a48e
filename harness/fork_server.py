"""A fork server for local swarms: one process imports what a peer needs once (torch, transformers and hivemind take
about 8 s of every peer's start on a 2-core machine), then forks a peer per request. Each child runs
``python -m swarm.serve``'s ``main`` with its own arguments and environment, writes its stdout to a file the parent
reads line by line and its stderr to its log, and is stopped by its PID like any other peer; the fork server reaps
the children and reports each exit code. When its parent goes (stdin closed, or the test process died) it stops the
children still running, by their PIDs, before it exits; a child whose fork server is killed gets SIGTERM.

The integration tests start about 160 peers, so they spawn through one (``LocalSwarm(spawner=...)``); everything else
starts peers with ``subprocess``. Before a fork nothing but imports has run: no torch op (its thread pools would not
survive a fork), no event loop, no thread; what an import made to share between processes (hivemind's process-wide
locks) each child makes anew, so a peer killed while holding one blocks no other peer. Peers get the fork server's
environment (libraries may have read it at import); ``LocalSwarm`` starts a peer that needs other variables with
``subprocess``.

A child may run another module's ``main(argv)`` instead (``spawn(..., main=MODULE)``: the attack tests fork their
malicious process, which needs the same imports), and in a network namespace (``spawn(..., netns=NAME)``: a WAN
emulator's node, ``harness.wan.nodes.WanSwarm``), which it enters before it runs anything (``setns``; what ``ip netns
exec`` does for the network, without its private mounts, which a peer does not use).

Protocol, one JSON object per line: requests ``{"argv", "env", "stdout", "stderr", "main", "netns"}`` on stdin; replies
``{"ready": true}`` once imported, ``{"pid": N}`` per request, ``{"exit": N, "code": C}`` per reaped child."""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from harness.env import child_env

_POLL_S = 0.05  # how often the server reaps and a reader looks for new output
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_CLONE_NEWNET = 0x40000000  # linux/sched.h
_STOP_GRACE_S = 20.0  # a peer's clean shutdown (DHT, p2pd) takes a few seconds on 2 busy cores


class ForkedPeer:
    """A forked peer, with the part of ``subprocess.Popen``'s interface ``LocalSwarm`` and the tests use."""

    def __init__(self, pid: int, stdout_path: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()
        self.stdout = _Lines(stdout_path, self._exited)

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Lines:
    """The lines of a file another process writes, until that process has exited and all is read."""

    def __init__(self, path: Path, exited: threading.Event) -> None:
        self._path, self._exited, self._closed = path, exited, False

    def __iter__(self) -> Iterator[str]:
        with open(self._path) as f:
            pending = ""
            while not self._closed:
                done = self._exited.is_set()  # read after: what was written before the exit is still read
                chunk = f.read()
                pending += chunk
                while "\n" in pending:
                    line, pending = pending.split("\n", 1)
                    yield line + "\n"
                if done and not chunk:
                    if pending:
                        yield pending
                    return
                if not chunk:
                    self._exited.wait(_POLL_S)

    def close(self) -> None:
        self._closed = True


class ForkServer:
    """The parent's handle on a fork server process (stop it with ``close``)."""

    def __init__(self, startup_timeout: float = 120.0) -> None:
        self.env = child_env({"PYTHONUNBUFFERED": "1"})
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.fork_server", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self._children: dict[int, ForkedPeer] = {}
        self._exits: dict[int, int] = {}  # reported before the spawner registered the child
        self._pids: list[int] = []
        self._lock = threading.Condition()
        # one request in flight at a time: the server answers pids in request order, and a waiter releases _lock
        self._spawning = threading.Lock()
        self._ready = False
        threading.Thread(target=self._read, daemon=True).start()
        with self._lock:
            if not self._lock.wait_for(lambda: self._ready or self._proc.poll() is not None, startup_timeout):
                self.close()
                raise RuntimeError("the fork server did not start")
        if not self._ready:
            raise RuntimeError(f"the fork server exited with {self._proc.poll()}")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(int(msg["pid"]))
                elif "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is not None:
                        child._set_exit(code)
                    else:
                        self._exits[pid] = code
                self._lock.notify_all()
        with self._lock:  # the server is gone: so are the exit reports of children still running
            self._lock.notify_all()

    def spawn(
        self,
        argv: Sequence[str],
        log_path: Path,
        timeout: float = 30.0,
        main: str = "swarm.serve",
        netns: str | None = None,
    ) -> ForkedPeer:
        """Fork a peer running ``python -m swarm.serve *argv`` (or ``python -m MAIN *argv``), inside the network
        namespace ``netns`` if given (``ip netns``' name); its stderr goes to ``log_path``, its stdout to
        ``log_path`` with the suffix ``.out``."""
        stdout_path = log_path.with_suffix(".out")
        stdout_path.write_text("")
        request = {
            "argv": list(argv),
            "env": self.env,
            "stdout": str(stdout_path),
            "stderr": str(log_path),
            "main": main,
            "netns": netns,
        }
        assert self._proc.stdin is not None
        with self._spawning, self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            if not self._lock.wait_for(lambda: self._pids or self._proc.poll() is not None, timeout):
                raise RuntimeError("the fork server did not answer")
            if not self._pids:
                raise RuntimeError(f"the fork server exited with {self._proc.poll()}")
            pid = self._pids.pop(0)
            child = ForkedPeer(pid, stdout_path)
            if pid in self._exits:
                child._set_exit(self._exits.pop(pid))
            else:
                self._children[pid] = child
        return child

    def close(self) -> None:
        """Stop the fork server (its children are stopped by their owners, by PID)."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # end of requests: it stops any child still running, then exits
            try:
                self._proc.wait(3 * _STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


# ---- the fork server process ---------------------------------------------------------------------------------------
def _child(request: dict[str, Any], server: int) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    _term_with_parent(server)
    if request.get("netns"):
        _enter_netns(str(request["netns"]))
    _own_process_locks()
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [f"python -m {request['main']}", *request["argv"]]
    code: int = importlib.import_module(request["main"]).main(list(request["argv"]))
    return code


def _enter_netns(name: str) -> None:
    """Move this (single-threaded, just forked) process into the network namespace ``ip netns add`` named ``name``."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def _own_process_locks() -> None:
    """Give this child hivemind's process-wide locks of its own. hivemind makes them at import (``mp.Lock()``: a
    semaphore in shared memory), so every child forked after the server's imports would share the same ones with
    every other peer of the swarm; a peer killed (SIGKILL) while it held one, for the microseconds an MPFuture's update
    or allocation takes, would leave it taken for all of them, and every peer's next DHT call, a newcomer's DHT start
    included, would hang on it. A process started with ``python -m swarm.serve`` makes its own at import, as these."""
    import multiprocessing as mp

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # MPFuture's initialization and update locks, and SharedBytes' allocation lock
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def _term_with_parent(server: int) -> None:
    """SIGTERM this process when its parent (``server``) dies: a peer when the fork server dies (killed, it cannot
    stop its children itself), the fork server when the process that started it does (the thread that started it,
    strictly: ``ForkServer`` is made on a thread that lives as long as its peers)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != server:  # the server died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _fork(request: dict[str, Any], out: IO[str], running: set[int]) -> None:
    out.flush()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            code = _child(request, server)
        except SystemExit as e:  # argparse's errors: leave as any child does, never through the server's loop
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else 1 if e.code else 0
        except BaseException:
            traceback.print_exc()
            code = 1
        _exit(code)
    running.add(pid)
    out.write(json.dumps({"pid": pid}) + "\n")
    out.flush()


def _exit(code: int) -> None:
    """End a peer as ``python -m swarm.serve`` ends, less the interpreter's teardown of every module: its threads are
    joined and its atexit handlers run (the DHT's child processes are joined there), so nothing is left running behind
    it, and the process exits with the peer's code. Tearing down torch's and transformers' modules object by object
    costs seconds of CPU per peer and does nothing a process's exit does not."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads, executors
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _reap(out: IO[str], running: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        running.discard(pid)
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


def _stop_left(running: set[int], out: IO[str]) -> None:
    """Stop the children still running when the parent is gone (it closed stdin, or died: a test process that crashed
    never stops its peers, and they and their p2pd would outlive it). SIGTERM is a peer's clean shutdown (its DHT
    and p2pd stop with it); one still running after the grace is killed. Only this server's own children, by PID."""
    for sig, grace in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, _STOP_GRACE_S)):
        for pid in list(running):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                running.discard(pid)
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            _reap(out, running)
            time.sleep(_POLL_S)
        if not running:
            return


def serve(parent: int) -> None:
    # a parent killed without closing stdin (SIGKILL, or a default SIGTERM) takes this server with it, and the
    # server's death its peers (theirs is SIGTERM too: ``_child``). The end of stdin alone is not enough: a process
    # the parent forked meanwhile (a client's DHT) inherits the pipe's write end and keeps it open
    _term_with_parent(parent)
    from swarm.serve import preload

    preload()  # the imports every peer pays for, paid once here

    if threading.active_count() > 1:  # a fork copies only this thread: another's locks would stay taken forever
        raise RuntimeError(f"an import started threads: {threading.enumerate()}")
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    stdin = sys.stdin
    buffered = ""
    running: set[int] = set()
    while True:
        readable, _, _ = select.select([stdin], [], [], _POLL_S)
        if readable:
            data = os.read(stdin.fileno(), 1 << 16).decode()
            if not data:  # the parent closed it: no more peers
                break
            buffered += data
            while "\n" in buffered:
                line, buffered = buffered.split("\n", 1)
                _fork(json.loads(line), out, running)
        _reap(out, running)
    _stop_left(running, out)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
