"""The router process: reads every node's TUN, holds each IPv4 packet as the timing model says, writes it to its
destination's TUN. Run as ``python -m harness.wan.router SPEC_JSON`` with the TUN fds inherited (``Wan`` starts it).

It is a process of its own, not a thread of the caller, so a busy caller (a test, a benchmark, a client holding the
GIL) never delays packets. Packets are forwarded untouched (but for the address translation of emulated NATs,
``harness.wan.nat``), so the TCP connection stays end to end between the two programs: slow start, losses and
retransmissions happen as over a real path, unlike with a relay per listener.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from types import FrameType

from harness.wan.links import Link, Topology
from harness.wan.nat import Nat, NatBox
from harness.wan.tun import MAX_READ, ipv4_dst, wire_cost

INITIAL_LEAD_S = 0.0001  # how early timers are set, until the router has seen how late they fire here
MAX_LEAD_S = 0.001  # the most a timer may be set early to make up for its wake-up latency
LEAD_GAIN = 0.1  # weight of the latest timer wake-up in the running average of their lateness
PR_SET_TIMERSLACK = 29
IDLE_WAKE_S = 0.5  # wake at least this often to notice that the parent has gone
READS_PER_WAKE = 64  # frames read from one TUN before the others get a turn
ARRIVE, DELIVER = 0, 1


@dataclass(frozen=True)
class RouterSpec:
    """What the router needs, in plain JSON types: the TUN fds in node order and the links between them."""

    fds: list[int]
    addresses: list[str]
    delay_ms: list[list[float]]  # [src][dst]
    mbit: list[float | None]  # per node, each way
    queue_ms: list[float]  # per node: how long its links' queues may grow before they drop
    jitter_ms: float = 0.0
    loss: float = 0.0
    seed: int | None = None
    nat_boxes: list[tuple[str, str, float]] = field(default_factory=list)  # (outside address, kind, timeout)
    nat_behind: list[tuple[str, str]] = field(default_factory=list)  # (inside address, its NAT's outside address)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RouterSpec:
        return cls(**json.loads(text))

    def nat(self) -> Nat | None:
        if not self.nat_boxes:
            return None
        boxes = {socket.inet_aton(a): NatBox(socket.inet_aton(a), kind, t) for a, kind, t in self.nat_boxes}
        return Nat(boxes, {socket.inet_aton(i): socket.inet_aton(o) for i, o in self.nat_behind})

    def topology(self) -> Topology:
        def link(mbit: float | None, queue_ms: float) -> Link:
            return Link(None if mbit is None else mbit * 1e6 / 8, queue_ms / 1000)

        return Topology(
            delay_s=[[d / 1000 for d in row] for row in self.delay_ms],
            uplinks=[link(m, q) for m, q in zip(self.mbit, self.queue_ms, strict=True)],
            downlinks=[link(m, q) for m, q in zip(self.mbit, self.queue_ms, strict=True)],
            jitter_s=self.jitter_ms / 1000,
            loss=self.loss,
            seed=self.seed,
        )


@dataclass
class Counters:
    """Per node: what it sent into the WAN and what became of it (printed on exit, for benchmarks' logs)."""

    packets: list[int] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    queue_drops: list[int] = field(default_factory=list)
    random_losses: list[int] = field(default_factory=list)
    unroutable: int = 0
    nat_drops: int = 0  # packets a NAT box let not in (or out: no hairpinning, a protocol it does not map)


class _Stop(Exception):
    """Raised by the SIGTERM/SIGINT handler so a blocking select ends at once."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def set_timer_slack(ns: int = 1) -> None:
    """Ask the kernel to fire this process's timers on time (the default slack is 50 µs, in each direction)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def route(spec: RouterSpec) -> Counters:
    """Forward packets until SIGTERM/SIGINT or until the parent process is gone.

    A ``select`` timeout wakes the process late, by 50-150 µs in a virtual machine and more under load; on each of
    a round trip's hops that would add up to ~0.5 ms. So the router learns how late its timers fire (an average
    of the last ones) and sets them that much early; what is due within that lead is sent at once, since waking
    again for it would make it later still."""
    topo = spec.topology()
    nat = spec.nat()
    n = len(spec.fds)
    node_of = {socket.inet_aton(a): i for i, a in enumerate(spec.addresses)}
    fd_node = {fd: i for i, fd in enumerate(spec.fds)}
    for fd in spec.fds:
        os.set_blocking(fd, False)
    counters = Counters([0] * n, [0] * n, [0] * n, [0] * n)
    heap: list[tuple[float, int, int, int, int, bytes]] = []  # (due, seq, kind, dst, cost, frame)
    seq = itertools.count()
    parent = os.getppid()
    lead_s = INITIAL_LEAD_S
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    print("ready", flush=True)
    try:
        while os.getppid() == parent:
            now = time.monotonic()
            while heap and heap[0][0] <= now + lead_s:
                due, _, kind, dst, cost, frame = heapq.heappop(heap)
                if kind == ARRIVE:
                    # The downlink is modelled when the packet gets there, so packets from several senders
                    # share it in the order they arrive, not the order they were sent.
                    at = topo.delivery(dst, due, cost)
                    if at is None:
                        counters.queue_drops[dst] += 1
                        continue
                    if at > now + lead_s:
                        heapq.heappush(heap, (at, next(seq), DELIVER, dst, cost, frame))
                        continue
                try:
                    os.write(spec.fds[dst], frame)
                except OSError:  # the receiver's device is down or its queue full: the packet is lost
                    counters.queue_drops[dst] += 1
            timeout = max(min(heap[0][0] - now - lead_s, IDLE_WAKE_S), 0.0) if heap else IDLE_WAKE_S
            readable, _, _ = select.select(spec.fds, [], [], timeout)
            woke = time.monotonic()
            if heap and not readable and timeout > 0.0:  # a timer wake-up: learn how late it was
                late = woke - (now + timeout)
                lead_s = min(max(lead_s + LEAD_GAIN * (late - lead_s), 0.0), MAX_LEAD_S)
            now = woke
            for fd in readable:
                src = fd_node[fd]
                for _ in range(READS_PER_WAKE):
                    try:
                        frame = os.read(fd, MAX_READ)
                    except (BlockingIOError, InterruptedError):
                        break
                    if nat is not None:  # NAT boxes rewrite at the edge; timing is by the two nodes' link
                        translated = nat.translate(frame, now)
                        if translated is None:
                            counters.nat_drops += 1
                            continue
                        frame = translated
                    target = node_of.get(ipv4_dst(frame) or b"")
                    if target is None or target == src:  # IPv6 router solicitations and the like
                        counters.unroutable += 1
                        continue
                    cost, segments = wire_cost(frame)
                    counters.packets[src] += 1
                    counters.wire_bytes[src] += cost
                    if topo.lost(segments):
                        counters.random_losses[src] += 1
                        continue
                    arrival = topo.arrival(src, target, now, cost)
                    if arrival is None:
                        counters.queue_drops[src] += 1
                        continue
                    heapq.heappush(heap, (arrival, next(seq), ARRIVE, target, cost, frame))
    except _Stop:
        pass
    return counters


def main(argv: list[str]) -> int:
    spec = RouterSpec.from_json(argv[1])
    try:
        os.nice(-10)  # a packet's delay should not depend on how busy the machine's other processes are
    except OSError:
        pass
    set_timer_slack()
    counters = route(spec)
    print(json.dumps(asdict(counters)), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
