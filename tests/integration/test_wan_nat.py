"""Emulated NATs for real: nodes behind each kind of home router (and a double NAT) in their own namespaces, real TCP
and UDP sockets through the WAN router. A connection out of a NAT arrives from the NAT's outside address; nothing
unasked gets in (nor through a stateful firewall, which translates nothing); and UDP hole punching through a
rendezvous works between the kinds that allow it and fails where a symmetric NAT meets a filtering one (RFC 4787's
matrix). Needs root, /dev/net/tun and ``ip``; skipped otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from harness.wan import Wan, WanConfig, unavailable_reason
from harness.wan.config import NatConfig

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

BEHIND = {"full": "full-cone", "rest": "restricted-cone", "port": "port-restricted", "sym": "symmetric"}


@pytest.fixture(scope="module")
def wan():
    nats = [NatConfig(name=f"nat-{node}", kind=kind, inside=(node,)) for node, kind in BEHIND.items()]
    # a home router behind the carrier's NAT: the double NAT of many mobile and fibre lines
    nats += [
        NatConfig(name="home", kind="port-restricted", inside=("dbl",)),
        NatConfig(name="cgn", kind="port-restricted", inside=("home",)),
    ]
    # a stateful firewall that translates nothing (a rented server's, or IPv6 at home)
    nats.append(NatConfig(name="wall", kind="firewall", inside=("fw",)))
    cfg = WanConfig(nodes=("pub", *BEHIND, "dbl", "fw"), delay_ms=5.0, nats=tuple(nats))
    with Wan(cfg) as running:
        yield running


SERVER = textwrap.dedent(
    """
    import json, socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7100))
    s.listen(); s.settimeout(20); print("ready", flush=True); seen = {}
    while len(seen) < int(sys.argv[1]):
        c, addr = s.accept(); seen[c.recv(64).decode()] = addr[0]; c.sendall(b"ok"); c.close()
    print(json.dumps(seen), flush=True)
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys
    c = socket.create_connection((sys.argv[1], 7100), timeout=10); c.sendall(sys.argv[2].encode())
    assert c.recv(2) == b"ok"
    """
)
DIAL = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5); print("connected")
    except OSError as e:
        print(type(e).__name__)
    """
)


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"


def test_connections_out_of_each_nat_arrive_from_its_outside_address(wan):
    inside = [*BEHIND, "dbl"]
    server = wan.popen("pub", [sys.executable, "-c", SERVER, str(len(inside))], stdout=subprocess.PIPE, text=True)
    _ready(server)
    for node in inside:
        done = wan.run(node, [sys.executable, "-c", CLIENT, wan.address("pub"), node], timeout=30)
        assert done.returncode == 0, node
    out, _ = server.communicate(timeout=30)
    seen = json.loads(out)
    assert seen == {node: wan.public_address(node) for node in inside}
    assert all(wan.public_address(n) != wan.address(n) for n in inside)
    assert wan.public_address("dbl") == wan.config.nat_address("cgn")  # the carrier's, not the home router's


def test_nothing_unasked_gets_in(wan):
    server = wan.popen("port", [sys.executable, "-c", SERVER, "1"], stdout=subprocess.PIPE, text=True)
    _ready(server)
    try:
        for where in (wan.address("port"), wan.public_address("port")):  # its own address, its NAT's
            for port in ("7100", "20000"):
                dial = wan.run("pub", [sys.executable, "-c", DIAL, where, port], capture_output=True, text=True)
                assert dial.stdout.strip() in ("TimeoutError", "OSError", "ConnectionRefusedError"), (where, port)
                assert dial.stdout.strip() != "connected"
    finally:
        server.kill()
        server.wait()
    # the same dial from a public node to a public one connects: the refusals above are the NATs'
    server = wan.popen("pub", [sys.executable, "-c", SERVER, "1"], stdout=subprocess.PIPE, text=True)
    _ready(server)
    done = wan.run("full", [sys.executable, "-c", CLIENT, wan.address("pub"), "full"], timeout=30)
    assert done.returncode == 0
    server.communicate(timeout=30)


def test_a_firewall_keeps_addresses_and_lets_only_answers_in(wan):
    assert wan.public_address("fw") == wan.address("fw")
    server = wan.popen("pub", [sys.executable, "-c", SERVER, "1"], stdout=subprocess.PIPE, text=True)
    _ready(server)
    done = wan.run("fw", [sys.executable, "-c", CLIENT, wan.address("pub"), "fw"], timeout=30)
    assert done.returncode == 0
    out, _ = server.communicate(timeout=30)
    assert json.loads(out) == {"fw": wan.address("fw")}  # untranslated
    server = wan.popen("fw", [sys.executable, "-c", SERVER, "1"], stdout=subprocess.PIPE, text=True)
    _ready(server)
    try:
        dial = wan.run("pub", [sys.executable, "-c", DIAL, wan.address("fw"), "7100"], capture_output=True, text=True)
        assert dial.stdout.strip() == "TimeoutError", dial.stdout  # dropped, not refused: the listener never saw it
    finally:
        server.kill()
        server.wait()


# (a, b, whether a UDP hole punch between them works): RFC 4787's matrix, a double NAT as its outer box
PAIRS = [
    ("full", "rest", True),
    ("rest", "port", True),
    ("port", "dbl", True),
    ("full", "sym", True),  # the full cone admits the symmetric NAT's new port, and the answer goes back through it
    ("rest", "sym", True),  # an address-restricted cone admits it too: same address, another port
    ("port", "sym", False),  # the symmetric NAT's packets come from a port nobody was told about
    ("sym", "dbl", False),
]


def test_udp_hole_punching_works_where_the_nats_allow_it(wan):
    procs = []
    for i, (a, b, _) in enumerate(PAIRS):
        port = 7200 + i
        rendezvous = wan.popen(
            "pub",
            [sys.executable, "-m", "harness.wan.punch", "rendezvous", str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        _ready(rendezvous)
        peers = [
            wan.popen(
                node,
                [
                    sys.executable,
                    *("-m", "harness.wan.punch", "peer", wan.address("pub"), str(port), node),
                    *("--local-port", str(5000 + i), "--seconds", "2"),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for node in (a, b)
        ]
        procs.append((rendezvous, peers))
    for (a, b, works), (rendezvous, peers) in zip(PAIRS, procs, strict=True):
        results = [json.loads(p.communicate(timeout=30)[0])["reached"] for p in peers]
        rendezvous.communicate(timeout=30)
        assert results == [works, works], (a, b, results)
