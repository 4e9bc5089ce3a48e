"""Tiny TCP programs run inside the nodes to measure a path: an echo server and a ping-pong client for round trips,
a sink and a sender for throughput. ``python -m harness.wan.probe MODE ...``; servers print their port, then one JSON
result line when done; clients print one JSON line.

They are plain sockets in plain processes on purpose: what they measure is what any TCP program would see.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def _listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    return server


def echo(host: str) -> None:
    """Echo every byte of one connection back, until it closes."""
    with _listen(host) as server:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(65536):
                conn.sendall(data)
    print(json.dumps({"done": True}), flush=True)


def ping(host: str, port: int, count: int, size: int) -> None:
    """``count`` round trips of ``size`` bytes, one at a time; prints the connect time and every round trip (ms)."""
    message = b"x" * size
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=30) as conn:
        connect_ms = (time.perf_counter() - t0) * 1000
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(count):
            t = time.perf_counter()
            conn.sendall(message)
            got = 0
            while got < size:
                data = conn.recv(size - got)
                if not data:
                    raise ConnectionError("echo server closed early")
                got += len(data)
            samples.append((time.perf_counter() - t) * 1000)
    print(json.dumps({"connect_ms": connect_ms, "rtt_ms": samples}), flush=True)


def sink(host: str, warmup: int) -> None:
    """Read one connection to its end, in two phases. The first ``warmup`` bytes open the congestion window (slow
    start); once they are all in, the sink says "go" and times the rest from its first packet to the end.

    Timing from a byte count reached mid-stream would be wrong by up to a window: segments that arrived behind a
    lost one wait in the receiver's out-of-order queue and are handed over only with the retransmission, so they
    would count as received after the mark though they crossed the link before it. After "go" the path is empty.
    """
    with _listen(host) as server:
        conn, _ = server.accept()
        accepted = time.perf_counter()
        buf = bytearray(CHUNK)
        received = 0
        with conn:
            while received < warmup and (n := conn.recv_into(buf, min(CHUNK, warmup - received))):
                received += n
            conn.sendall(b"g")
            first = conn.recv_into(buf)
            steady_from, steady_bytes = time.perf_counter(), 0
            received += first
            while n := conn.recv_into(buf):
                received += n
                steady_bytes += n
        end = time.perf_counter()
    steady_s = end - steady_from
    result = {
        "bytes": received,
        "seconds": end - accepted,
        "mbit": received * 8 / 1e6 / (end - accepted),
        "steady_bytes": steady_bytes,
        "steady_seconds": steady_s,
        "steady_mbit": steady_bytes * 8 / 1e6 / steady_s if steady_bytes else 0.0,
    }
    print(json.dumps(result), flush=True)


def send(host: str, port: int, nbytes: int, warmup: int) -> None:
    """Send ``warmup`` bytes, wait for the sink's "go", send the rest and close; the sink does the timing, since
    it sees when bytes actually arrive."""
    block = memoryview(b"\0" * CHUNK)
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=60) as conn:

        def push(count: int) -> None:
            while count > 0:
                n = min(count, CHUNK)
                conn.sendall(block[:n])
                count -= n

        push(warmup)
        if conn.recv(1) != b"g":
            raise ConnectionError("the sink closed before saying go")
        push(nbytes - warmup)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the sink to close, so every byte was received
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def main(argv: list[str]) -> int:
    mode, args = argv[1], argv[2:]
    if mode == "echo":
        echo(args[0])
    elif mode == "ping":
        ping(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif mode == "sink":
        sink(args[0], int(args[1]))
    elif mode == "send":
        send(args[0], int(args[1]), int(args[2]), int(args[3]))
    else:
        usage = "echo HOST | ping HOST PORT COUNT SIZE | sink HOST WARMUP | send HOST PORT N WARMUP"
        print(f"unknown mode {mode!r}: {usage}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
