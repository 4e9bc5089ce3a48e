"""Measuring a path of a running WAN with the probes of ``probe.py``, run as processes inside the two nodes: the
median TCP round trip and the steady-state throughput, for tests and for benchmarks' reports."""

from __future__ import annotations

import json
import select
import statistics
import subprocess
from typing import IO, Any

from harness.wan.emulator import Wan
from harness.wan.netns import WanError

TIMEOUT_S = 120.0


def _server(wan: Wan, node: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """Start a probe server in ``node``; return it and the port it listens on."""
    proc = wan.popen(
        node,
        [wan.python, "-m", "harness.wan.probe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = _readline(proc.stdout, 30.0)
    if not line.strip().isdigit():
        proc.kill()
        _, err = proc.communicate()
        raise WanError(f"probe server in {node} did not start: {line!r} {err.strip()}")
    return proc, int(line)


def _readline(stream: IO[str] | None, timeout: float) -> str:
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def _client(wan: Wan, node: str, *args: str) -> dict[str, Any]:
    done = wan.run(
        node, [wan.python, "-m", "harness.wan.probe", *args], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if done.returncode != 0:
        raise WanError(f"probe {args[0]} in {node} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise WanError(f"probe server failed: {err.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def rtt_samples(wan: Wan, a: str, b: str, count: int = 40, size: int = 32) -> dict[str, Any]:
    """``count`` TCP round trips of ``size`` bytes from ``a`` to an echo server in ``b``, one connection: the
    connect time and every sample in ms."""
    server, port = _server(wan, b, "echo", wan.address(b))
    try:
        result = _client(wan, a, "ping", wan.address(b), str(port), str(count), str(size))
    except BaseException:
        server.kill()
        server.wait()
        raise
    _result(server)
    return result


def measure_rtt(wan: Wan, a: str, b: str, count: int = 40, warmup: int = 5) -> float:
    """The median TCP round trip in ms between ``a`` and ``b`` (the first ``warmup`` samples left out: they pay
    for the connection's and the probes' first use). Configured: twice the pair's one-way delay."""
    samples = rtt_samples(wan, a, b, count + warmup)["rtt_ms"]
    return float(statistics.median(samples[warmup:]))


def throughput(wan: Wan, a: str, b: str, nbytes: int, warmup_bytes: int | None = None) -> dict[str, Any]:
    """Send ``nbytes`` over one TCP connection from ``a`` to a sink in ``b``; the sink's report (``steady_mbit``:
    after ``warmup_bytes``, by default a quarter, so slow start is left out; ``mbit``: the whole connection)."""
    warmup = min(nbytes // 4 if warmup_bytes is None else warmup_bytes, nbytes - 1)
    server, port = _server(wan, b, "sink", wan.address(b), str(warmup))
    try:
        _client(wan, a, "send", wan.address(b), str(port), str(nbytes), str(warmup))
    except BaseException:
        server.kill()
        server.wait()
        raise
    return _result(server)


def measure_throughput(wan: Wan, a: str, b: str, nbytes: int = 16 << 20) -> float:
    """Steady-state TCP throughput in Mbit/s (goodput) from ``a`` to ``b``. Configured: the smaller of the two
    nodes' bandwidths; goodput is ~3.5% below it, the IP and TCP headers of 1500-byte packets."""
    return float(throughput(wan, a, b, nbytes)["steady_mbit"])
