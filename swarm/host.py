"""What this machine is, read without starting a process."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's architecture. Never ``platform.processor()``: it
    runs ``uname -p`` in a subprocess, and a subprocess started while another thread forks (a client's DHT process)
    can hang for good: the forked child inherits the pipe through which ``subprocess`` waits for the exec, and never
    closes it (seen with nine clients created at once in one process, ``scripts/bench_scale.py``)."""
    cpu = platform.machine() or "cpu"  # os.uname(): no subprocess
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu
