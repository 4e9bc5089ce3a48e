"""Network namespaces through the ``ip`` command, and the state file that lets ``down`` remove what a crashed
emulator left: only the names and the PID it recorded, never anything found by a pattern."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


class WanError(RuntimeError):
    """The emulator could not be set up or torn down."""


def unavailable_reason() -> str | None:
    """Why no WAN can be emulated here (not root, no TUN, no ``ip``), or None when it can."""
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "the WAN emulator needs /dev/net/tun"
    if shutil.which("ip") is None:
        return "the WAN emulator needs the `ip` command (iproute2)"
    return None


def ip(*args: str, batch: list[str] | None = None) -> str:
    """Run ``ip ARGS`` (with ``batch`` as ``-batch -`` lines); its stdout, or WanError with its stderr."""
    argv = ["ip", *args] + (["-batch", "-"] if batch is not None else [])
    stdin = "".join(line + "\n" for line in batch) if batch is not None else None
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise WanError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> set[str]:
    """Names of the namespaces ``ip netns`` knows now."""
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def namespace_pids(namespace: str) -> list[int]:
    """Processes inside ``namespace`` (started there by anyone: they all belong to the emulated node)."""
    try:
        return [int(p) for p in ip("netns", "pids", namespace).split()]
    except WanError:
        return []


def delete_namespace(namespace: str, grace_s: float = 2.0) -> None:
    """End the processes still inside ``namespace`` (TERM, then KILL after ``grace_s``) and delete it. Deleting
    alone would only unname it: the kernel keeps a namespace as long as one process is in it."""
    pids = namespace_pids(namespace)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    signal_all([p for p in pids if _alive(p)], signal.SIGKILL)
    if namespace in namespaces():
        ip("netns", "delete", namespace)


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), which tells a PID reused by another process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, IndexError, ValueError):
        return None


@dataclass
class State:
    """What one emulator made: its namespaces and its router's PID (with start time, so a reused PID is spared)."""

    prefix: str
    namespaces: list[str]
    router_pid: int | None = None
    router_start: int | None = None
    owner_pid: int = 0

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> State:
        return cls(**json.loads(path.read_text()))


def stop_process(pid: int, started: int | None, grace_s: float = 3.0) -> None:
    """TERM, then KILL, the process ``pid`` if it is still the one that started at ``started``."""
    if started is None or start_time(pid) != started:
        return
    signal_all([pid], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid) and start_time(pid) == started:
        signal_all([pid], signal.SIGKILL)


def tear_down(state: State) -> list[str]:
    """Remove what ``state`` records: stop its router, then delete each of its namespaces that still exists.
    Returns the namespaces deleted."""
    if state.router_pid is not None:
        stop_process(state.router_pid, state.router_start)
    present = namespaces()
    gone = []
    for ns in state.namespaces:
        if ns in present:
            delete_namespace(ns)
            gone.append(ns)
    return gone
