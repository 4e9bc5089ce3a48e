"""Relaying is the swarm's, within the bounds a volunteer gave, and nobody else's: a real ``swarm.serve --relay``
process with small bounds, and real p2p daemons in this process as the peers that push against them. A peer that
offers no relaying answers no reservation (the daemon's built-in relay, which would carry 128 KiB a connection for
anyone whatever its flags, is taken off); the relay grants at most ``--relay-max-reservations`` slots, at most
``--relay-max-circuits`` connections to a peer, and closes a connection past ``--relay-mb`` each way, while
carrying more than the daemon's own 128 KiB; and it goes on serving."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from peers.relay_slots import reserve
from swarm.circuit import CircuitError
from swarm.dht import dht_time, start_dht
from swarm.identity import new_identity_file
from swarm.records import PeerRecord, PeerState
from swarm.relay import RelayPolicy, dial_addr
from tests.helpers.swarms import connect, descendants, running_swarm

ECHO = "swarm-test-echo"
MIB = 1 << 20
RELAY = "/ip4/127.0.0.1/tcp/9/p2p/QmQJ8QnNsJdRrw9YQ8NikgevHeXB1yCpvg7oKenzAHp8ic"  # named, never dialled here


def _full(store) -> str:
    return f"{store.visible_maddrs()[0]}/p2p/{store.peer_id}"


def _p2pd_args(store) -> list[str]:
    pids = [p for p in descendants(store.dht.pid) if Path(f"/proc/{p}/exe").resolve().name == "p2pd"]
    argvs = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in pids]
    assert len(argvs) == 1, argvs  # the DHT's own p2pd
    return [x.decode() for x in argvs[0] if x]


@pytest.mark.parametrize(
    "policy, present",
    [
        (None, ["-relayService=0", "-autoRelay=0"]),
        (RelayPolicy(reachability="public"), ["-forceReachabilityPublic=1", "-autoRelay=0"]),
        (RelayPolicy(reachability="private"), ["-forceReachabilityPrivate=1", "-autoRelay=0", "-relay=1"]),
    ],
)
def test_the_daemon_is_told_its_reachability_and_keeps_relaying_to_the_swarm(policy, present):
    store = start_dht(relay=policy)
    try:
        args = _p2pd_args(store)
        for flag in present:
            assert flag in args, (flag, args)
    finally:
        store.shutdown()


def test_a_peer_that_offers_no_relaying_grants_no_slot():
    store = start_dht()  # default policy: no --relay
    other = start_dht(initial_peers=(_full(store),))
    try:

        async def ask() -> str:
            p2p = await other.replicate_p2p()
            try:
                await reserve(p2p, _full(store), timeout=10)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return "granted"

        answer = asyncio.run(ask())
        assert answer != "granted"
        assert "protocol" in answer.lower() or "not supported" in answer.lower(), answer
    finally:
        other.shutdown()
        store.shutdown()


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_circuits must be positive"):
        RelayPolicy(offer=True, max_circuits=0)
    with pytest.raises(ValueError, match="reachability is one of"):
        RelayPolicy(reachability="sometimes")  # type: ignore[arg-type]


async def _echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def _through(stranger: P2P, target: P2P, relay: str, size: int) -> int:
    """Bytes echoed back of ``size`` sent from ``stranger`` to ``target`` through ``relay``."""
    await stranger._client.connect(target.peer_id, [dial_addr(f"{relay}/p2p-circuit/p2p/{target.peer_id}")])
    info, reader, writer = await stranger.call_binary_stream_handler(target.peer_id, ECHO)
    assert "/p2p-circuit" in str(info.addr), info  # relayed, not a direct connection the daemons made on their own

    async def send() -> None:
        with contextlib.suppress(Exception):
            for offset in range(0, size, 65536):
                writer.write(b"x" * min(65536, size - offset))
                await writer.drain()

    sender = asyncio.create_task(send())
    got = 0
    with contextlib.suppress(Exception):
        while got < size:
            chunk = await asyncio.wait_for(reader.read(65536), 15)
            if not chunk:
                break
            got += len(chunk)
    sender.cancel()
    writer.close()
    return got


def _member(relay: str, model_id: str, state: PeerState = PeerState.JOINING) -> Path:
    """A new identity whose own signed heartbeat is in the swarm, written by a DHT peer of that identity that is
    gone again: a daemon of it can then listen nowhere, as behind a NAT (two daemons of one identity would confuse
    the relay's connections)."""
    path = new_identity_file()
    store = start_dht(initial_peers=(relay,), identity=path)
    try:
        now = dht_time()
        beat = PeerRecord(
            peer_id=store.peer_id, state=state, block_throughput=1.0, memory=1, max_blocks=1, updated_at=now
        )
        assert store.heartbeat(model_id, beat, now + 60)
    finally:
        store.shutdown()
    return path


async def _reserve(p2p: P2P, relay: str) -> str:
    try:
        return f"granted {(await reserve(p2p, relay)).expire > 0}"
    except CircuitError as e:
        return str(e)


def test_a_relay_carries_what_its_bounds_allow_and_no_more(tiny_models):
    """Slots go only to peers whose own signed heartbeat is in the swarm, within the relay's bounds: an identity
    that never heartbeated and one whose heartbeat says it left are refused, and take no slot."""
    folder = str(tiny_models["llama"])
    model_id = Path(folder).name
    bounds = ("--relay", "--reachability", "public", "--relay-max-reservations", "2", "--relay-max-circuits", "1")
    with running_swarm(folder, ["0:4"], *bounds, "--relay-mb", "1") as swarm:
        relay = swarm.peers[0].maddr

        async def push() -> dict[str, object]:
            # listening nowhere, as behind a NAT: reached only through the relay (on one machine the daemons would
            # otherwise find each other's addresses and connect directly)
            made: list[P2P] = []

            async def create(identity: Path | None = None) -> P2P:
                made.append(await P2P.create(initial_peers=[relay], no_listen=True, identity_path=identity))
                return made[-1]

            out: dict[str, object] = {}
            try:
                out["never_heartbeated"] = await _reserve(await create(), relay)
                leaver = await create(await asyncio.to_thread(_member, relay, model_id, PeerState.LEAVING))
                out["left"] = await _reserve(leaver, relay)
                peers = [await create(await asyncio.to_thread(_member, relay, model_id)) for _ in range(3)]
                target, second, third = peers
                stranger = await create()
                for name, p2p in zip(("first", "second", "third"), peers, strict=True):
                    out[name] = await _reserve(p2p, relay)
                await target.add_binary_stream_handler(ECHO, _echo)
                out["small"] = await _through(stranger, target, relay, 256 << 10)  # twice p2pd's own 128 KiB limit
                out["big"] = await _through(stranger, target, relay, 3 * MIB)
                # one connection to the target at a time: a second stranger's dial while one is open is refused
                await _through(stranger, target, relay, 1024)
                try:
                    await second._client.connect(
                        target.peer_id, [dial_addr(f"{relay}/p2p-circuit/p2p/{target.peer_id}")]
                    )
                    out["second_circuit"] = "connected"
                except Exception as e:
                    out["second_circuit"] = str(e)
            finally:
                for p in made:
                    await p.shutdown()
            return out

        out = asyncio.run(push())
        assert "PERMISSION_DENIED" in str(out["never_heartbeated"]), out
        assert "PERMISSION_DENIED" in str(out["left"]), out
        assert out["first"] == out["second"] == "granted True", out
        assert "RESOURCE_LIMIT_EXCEEDED" in str(out["third"]), out
        assert out["small"] == 256 << 10, out
        assert int(out["big"]) <= MIB, out  # closed at --relay-mb, not carried to the end
        assert "RESOURCE_LIMIT_EXCEEDED" in str(out["second_circuit"]), out
        client = connect(folder, swarm)  # and the relay goes on serving
        try:
            assert len(client.connection.view.servers()) == 1
        finally:
            client.close()


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

    from tests.helpers.swarms import alive, wait_for

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


def test_a_public_peer_dials_a_caller_back_only_where_it_listens(tiny_models):
    """``swarm.dialback`` on a real server's direct plane: a port this host listens on is reached, a closed one is
    not; the answer is what ``--reachability auto`` decides by (``peers.reach.measure``)."""
    import socket

    from swarm.identity import Credentials
    from swarm.rpc.punch import dialback
    from swarm.rpc.secure import client_context

    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:4"]) as swarm:
        client = connect(folder, swarm)
        try:
            (server,) = client.connection.view.servers()
            observer = f"{server.peer_id}@{server.direct_address}"
            creds: Credentials = client.connection.remote.creds
            listening = socket.create_server(("127.0.0.1", 0))
            closed = socket.create_server(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]
            closed.close()
            try:

                async def ask(port: int) -> bool:
                    return await dialback(observer, port, creds, client_context(), 5.0)

                assert asyncio.run(ask(listening.getsockname()[1])) is True
                assert asyncio.run(ask(closed_port)) is False
            finally:
                listening.close()
        finally:
            client.close()
