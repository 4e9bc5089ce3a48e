"""What the client and server read of their machine starts no process: a subprocess started while another thread
forks (a client's DHT process) can wait for good on a pipe the forked child inherited (nine clients created at once
in ``scripts/bench_scale.py`` hung that way in ``platform.processor()``)."""

from __future__ import annotations

import subprocess

import pytest

from peers.hardware import probe_hardware
from swarm.host import cpu_name
from swarm.perf.calibration import machine_key


def test_the_machine_is_read_without_a_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    name = cpu_name()
    assert name and name in machine_key(2) and "2 thread(s)" in machine_key(2)
    assert probe_hardware("cpu").device_name == f"cpu: {name}"
