"""UDP hole punching between two nodes, for probing what an emulated NAT lets through (``python -m
harness.wan.punch``). A rendezvous on a public node learns each side's address as its NAT shows it and tells each the
other's; both then send to each other at once. Where both NATs keep one mapping per inside port (cones,
port-restricted), each side's first packets open its own NAT to the other, and the other's get in; a symmetric NAT
maps the packets to the peer to a port the rendezvous never saw, so they are dropped on the far side.

    python -m harness.wan.punch rendezvous PORT
    python -m harness.wan.punch peer RENDEZVOUS_IP PORT NAME [--seconds S]   # prints {"name":..., "reached": bool}
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

LOCAL_PORT = 5000
TRIES_EVERY_S = 0.05


def rendezvous(port: int, timeout_s: float = 30.0) -> None:
    """Pair the first two peers that register, telling each the other's observed address; then exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(timeout_s)
    seen: dict[str, tuple[str, int]] = {}
    print("ready", flush=True)
    while len(seen) < 2:
        data, addr = sock.recvfrom(512)
        seen[data.decode()[:64]] = addr
    (a, addr_a), (b, addr_b) = seen.items()
    for _ in range(5):  # UDP: sent a few times, the peers ignore repeats
        sock.sendto(f"{addr_b[0]} {addr_b[1]}".encode(), addr_a)
        sock.sendto(f"{addr_a[0]} {addr_a[1]}".encode(), addr_b)
        time.sleep(0.02)
    print(json.dumps({a: list(addr_a), b: list(addr_b)}), flush=True)


def peer(host: str, port: int, name: str, seconds: float, local_port: int = LOCAL_PORT) -> bool:
    """Register, learn the other peer's address, send to it for ``seconds``: whether anything of it got here."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", local_port))
    sock.settimeout(TRIES_EVERY_S)
    other: tuple[str, int] | None = None
    deadline = time.monotonic() + seconds + 10.0
    while other is None and time.monotonic() < deadline:
        sock.sendto(name.encode(), (host, port))
        try:
            data, addr = sock.recvfrom(512)
        except TimeoutError:
            continue
        if addr == (host, port):
            ip, _, p = data.decode().partition(" ")
            other = (ip, int(p))
    if other is None:
        return False
    reached = False
    targets = {other}  # and wherever the other's packets come from (a symmetric NAT's port for us)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for target in targets:
            sock.sendto(f"hi from {name}".encode(), target)
        try:
            data, addr = sock.recvfrom(512)
        except TimeoutError:
            continue
        if data.startswith(b"hi from"):
            reached = True
            targets.add(addr)
    return reached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.wan.punch", description=__doc__)
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("rendezvous")
    r.add_argument("port", type=int)
    c = sub.add_parser("peer")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("name")
    c.add_argument("--seconds", type=float, default=1.5)
    c.add_argument("--local-port", type=int, default=LOCAL_PORT)
    args = p.parse_args(argv)
    if args.role == "rendezvous":
        rendezvous(args.port)
    else:
        print(
            json.dumps(
                {"name": args.name, "reached": peer(args.host, args.port, args.name, args.seconds, args.local_port)}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
