"""What a peer's p2p daemon is started with about relaying, read from the running ``p2pd``'s own command line: no
relay service by default (p2pd's defaults would relay for anyone, unbounded here), the bounds given when a
volunteer offers one (``--relay``), and the reachability forced when one is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.dht import start_dht
from swarm.relay import RelayPolicy
from tests.integration.swarms import descendants

RELAY = "/ip4/127.0.0.1/tcp/9/p2p/QmQJ8QnNsJdRrw9YQ8NikgevHeXB1yCpvg7oKenzAHp8ic"  # named, never dialled here


def _p2pd_args(store) -> list[str]:
    pids = [p for p in descendants(store.dht.pid) if Path(f"/proc/{p}/exe").resolve().name == "p2pd"]
    argvs = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in pids]
    assert len(argvs) == 1, argvs  # the DHT's own p2pd
    return [x.decode() for x in argvs[0] if x]


@pytest.mark.parametrize(
    "policy, present, absent",
    [
        (None, ["-relayService=0", "-autoRelay=0"], ["-relayMaxCircuits", "-forceReachability"]),
        (
            RelayPolicy(offer=True, max_reservations=3, max_circuits=2, data_bytes=1 << 20, time_s=60),
            [
                "-relayService=1",
                "-relayMaxReservations=3",
                "-relayMaxCircuits=2",
                "-relayDataLimit=1048576",
                "-relayTimeLimit=60s",
                "-relayBufferSize=65536",
            ],
            [],
        ),
        (RelayPolicy(reachability="public"), ["-forceReachabilityPublic=1", "-autoRelay=0"], []),
        (RelayPolicy(reachability="private"), ["-forceReachabilityPrivate=1", "-autoRelay=1"], ["-trustedRelays"]),
        (
            RelayPolicy(reachability="private", relays=(RELAY,)),
            ["-forceReachabilityPrivate=1", "-autoRelay=1", f"-trustedRelays={RELAY}"],
            [],
        ),
    ],
)
def test_the_daemon_relays_only_within_the_bounds_it_was_given(policy, present, absent):
    store = start_dht(relay=policy)
    try:
        args = _p2pd_args(store)
        for flag in present:
            assert flag in args, (flag, args)
        for flag in absent:
            assert not any(a.startswith(flag) for a in args), (flag, args)
    finally:
        store.shutdown()


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_circuits must be positive"):
        RelayPolicy(offer=True, max_circuits=0)
    with pytest.raises(ValueError, match="reachability is one of"):
        RelayPolicy(reachability="sometimes")  # type: ignore[arg-type]


def test_a_private_peer_no_stranger_reaches_is_told_what_to_do():
    """``peers.reach``: a real probe daemon dials the relayed address (a relay nobody runs) until the deadline, and
    the volunteer gets the error that says what to change, not an announced address nobody can use."""
    import asyncio

    from peers.reach import reachable
    from swarm.errors import BadInputError

    me = "QmbTghmKayfByLZqY4eUqwERKtLM1tR5fJPj96J8GVTdhy"
    circuit = f"{RELAY}/p2p-circuit/p2p/{me}"
    with pytest.raises(BadInputError, match="not reachable through its relays .*--relay-via"):
        asyncio.run(reachable(me, (circuit,), timeout=1.0, period=0.5))


def test_a_peer_killed_mid_check_leaves_no_probe_daemon():
    """The probe's daemon dies with the peer that started it, even when that peer is killed (SIGKILL, by PID)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.integration.swarms import alive, wait_for

    me = "QmbTghmKayfByLZqY4eUqwERKtLM1tR5fJPj96J8GVTdhy"
    code = (
        "import asyncio; from peers.reach import reachable; "
        f"asyncio.run(reachable({me!r}, ({RELAY + '/p2p-circuit/p2p/' + me!r},), timeout=120.0))"
    )
    peer = subprocess.Popen([sys.executable, "-c", code])
    try:
        daemons: list[int] = []

        def probing() -> bool:
            daemons[:] = [p for p in descendants(peer.pid) if Path(f"/proc/{p}/exe").resolve().name == "p2pd"]
            return bool(daemons)

        wait_for(probing, 60, "the probe's daemon to start")
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        wait_for(lambda: not any(alive(p) for p in daemons), 20, "the probe's daemon to exit")
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
