"""What a process tree costs on this machine, read from /proc: its processes (a peer, its DHT child, their p2pd),
their proportional memory, their CPU time and the bytes their p2pd daemons moved. Linux only; for benchmarks."""

from __future__ import annotations

import os
from pathlib import Path


def tree(pid: int) -> list[int]:
    """A process and its descendants (a peer's DHT child and p2pd)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def pss(pids: list[int]) -> int:
    """Proportional set size: a page shared by k processes (the fork server's, copy-on-write) counts 1/k to each."""
    total = 0
    for p in pids:
        for line in _read(f"/proc/{p}/smaps_rollup").splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
    return total


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        stat = _read(f"/proc/{p}/stat")
        if stat:
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def p2pd_io(pids: list[int]) -> int:
    total = 0
    for p in pids:
        if "p2pd" not in _read(f"/proc/{p}/comm"):
            continue
        for line in _read(f"/proc/{p}/io").splitlines():
            if line.startswith(("rchar:", "wchar:")):
                total += int(line.split()[1])
    return total
