"""hivemind's DHT process, made safe to kill.

hivemind runs the DHT in a forked child that starts its own ``p2pd``. If the parent is SIGKILLed both would live on
as a ghost peer, so the child asks the kernel for SIGTERM when its parent dies, and on SIGTERM it kills its own
children (the ``p2pd`` it started) by PID before exiting. The DHT must be created from a thread that lives as long
as the process (the main thread): the kernel's parent-death signal follows the creating thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from types import FrameType

import hivemind
from hivemind.p2p import P2P

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _own_children(pid: int) -> list[int]:
    children: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _terminate_children_and_exit(signum: int, frame: FrameType | None) -> None:
    children = _own_children(os.getpid())
    for child in children:
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    for child in children:  # reap them, or they linger as zombies where PID 1 does not reap
        while time.monotonic() < deadline:
            try:
                if os.waitpid(child, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.02)
    os._exit(0)


def die_with_parent(parent_pid: int) -> None:
    """In a forked child: ask the kernel for SIGTERM when the parent dies, which then kills and reaps this child's
    own children (exit at once if the parent is already gone)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: fall back to hivemind's own behaviour
        log.warning("cannot ask for a parent-death signal; a killed parent may leave its children behind")
    signal.signal(signal.SIGTERM, _terminate_children_and_exit)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(0)


class _LockedPipe:
    """The parent's end of hivemind's request pipe to its DHT process. hivemind sends without a lock, and
    ``Connection.send`` writes a message over 16 KiB as two writes (its length, then its bytes): two threads sending
    at once (a session's route, a verifier's, an accusation's publisher) could interleave them. Sends take turns."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, obj: object) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name: str) -> object:  # the rest of the pipe, for hivemind
        return getattr(self._conn, name)


class _WholeRecv:
    """The DHT process's end of that pipe. Its loop watches the pipe with the descriptor non-blocking and reads a
    message once any byte of it is there; a message over 16 KiB (an accusation with its evidence) then often finds
    its length but not yet its bytes: the read fails with ``BlockingIOError``, hivemind logs it and reads on out of
    step, and the process dies on the next message (``EOFError: Ran out of input``). A read here blocks until the
    whole message is in: the sender writes the rest at once."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def recv(self) -> object:
        fd = self._conn.fileno()
        os.set_blocking(fd, True)
        try:
            return self._conn.recv()
        finally:
            os.set_blocking(fd, False)

    def __getattr__(self, name: str) -> object:  # the rest of the pipe, for hivemind
        return getattr(self._conn, name)


class OwnedDHT(hivemind.DHT):  # type: ignore[misc]  # hivemind ships no type information
    """A hivemind DHT whose child process (and its p2pd) never outlives the process that created it, its p2pd
    started with the flags ``p2pd_flags`` adds to hivemind's (``RelayPolicy.p2pd_flags``: hivemind passes none of
    the relay service's)."""

    def __init__(self, *args: object, p2pd_flags: dict[str, int | str] | None = None, **kwargs: object) -> None:
        self._p2pd_flags = dict(p2pd_flags or {})
        super().__init__(*args, **kwargs)
        self._outer_pipe = _LockedPipe(vars(self)["_outer_pipe"])  # this end only: the child reads the other

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        self._inner_pipe = _WholeRecv(vars(self)["_inner_pipe"])
        if self._p2pd_flags:  # in the DHT's own (forked) process only, where its one p2pd is started
            plain = P2P._make_process_args
            flags = self._p2pd_flags
            P2P._make_process_args = staticmethod(lambda *a, **kw: plain(*a, **{**kw, **flags}))
        super().run()
