"""Hole punching's parts (``swarm.rpc.punch``): a punch nobody answers ends at its deadline, a peer behind NAT is
reached directly for streams but never pooled, its signal is a control call, and an endpoint is an IPv4 address
and port. The punch itself needs crossing SYNs over a real delay (on loopback a SYN is answered before the other
side's leaves): tests/integration/test_nat_swarm.py punches through emulated NATs for real."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from swarm.hop import Hop
from swarm.nat_protocol import PunchRequest
from swarm.protocol import RPC_FORWARD, RPC_INFERENCE, RPC_PUNCH
from swarm.rpc.direct import DirectDialError
from swarm.rpc.punch import bound_socket, parse_observer, simultaneous_open
from swarm.rpc.transport import Transport, choose_transport

PEER = "QmQJ8QnNsJdRrw9YQ8NikgevHeXB1yCpvg7oKenzAHp8ic"


def test_a_side_nobody_answers_is_given_up_by_its_deadline():
    async def alone() -> None:
        port = bound_socket()
        try:
            await simultaneous_open(bound_socket().getsockname()[1], f"127.0.0.1:{port.getsockname()[1]}", 0.5)
        finally:
            port.close()

    with pytest.raises(DirectDialError, match="no punched connection"):
        asyncio.run(alone())


def test_a_peer_behind_nat_is_reached_directly_for_streams_and_signalled_over_libp2p():
    hop = Hop(PEER, 0, 2, punch_via=(f"{PEER}@10.0.0.1:4001",))
    assert choose_transport(hop, RPC_INFERENCE, 10, 1, "auto") == Transport.DIRECT
    assert choose_transport(hop, RPC_FORWARD, 10, 1, "auto") == Transport.UNARY  # no pool for it: libp2p
    assert choose_transport(hop, RPC_PUNCH, 10, 1, "auto") == Transport.UNARY
    assert choose_transport(hop, RPC_INFERENCE, 10, 1, "auto", reachable=False) == Transport.STREAM
    assert choose_transport(hop, RPC_INFERENCE, 10, 1, "never") == Transport.STREAM
    assert parse_observer(f"{PEER}@10.0.0.1:4001") == (PEER, "10.0.0.1:4001")


@pytest.mark.parametrize("bad", ["10.0.0.1", "10.0.0.1:80:90", "host:80", "[::1]:80", "1.2.3.4:123456"])
def test_an_endpoint_is_an_ipv4_address_and_port(bad):
    with pytest.raises(ValidationError):
        PunchRequest(address=bad)


def _peer_key():
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.identity import Credentials

    return Credentials.of(RSAPrivateKey())


def test_a_peer_punches_only_toward_its_caller_s_own_observed_endpoint():
    """``peers.rpc.punch_server.Puncher``: a punch is refused unless one of this peer's own observers signed, lately,
    that this very caller's connection came from the endpoint it names; and a loopback, link-local or private
    endpoint is refused where the peer itself is not in that range. Real keys and signatures; no packet is sent
    for a refused request."""
    import time

    from hivemind.p2p import PeerID

    from peers.rpc.framing import Caller
    from peers.rpc.punch_server import Puncher
    from swarm import wire
    from swarm.identity import sign_record
    from swarm.nat_protocol import Observation, PunchReply

    observer, stranger, caller, other = (_peer_key() for _ in range(4))

    def seen(by, who, address, made=None):
        obs = Observation(observer=by.peer_id, caller=who.peer_id, address=address, made=made or time.time())
        return sign_record(by.key, obs)

    async def ask(puncher, request, who) -> str:
        reply = await puncher.rpc_punch(
            wire.encode(request.model_dump(mode="json"))[0], Caller(PeerID.from_base58(who.peer_id))
        )
        meta, _ = wire.decode([reply], 1 << 16)
        if meta.get("error"):
            return str(meta["error"])
        return "punching toward " + PunchReply.model_validate(meta).address

    async def run() -> dict[str, str]:
        puncher = Puncher(None, observer, lambda: (f"{observer.peer_id}@203.0.113.7:4001",), None)  # type: ignore[arg-type]
        puncher.port, puncher.endpoint = bound_socket(), "93.184.216.34:5000"  # as its observers saw it: global
        out = {}
        try:
            there = "81.2.69.160:6000"  # a global address: no request naming it is granted, so no SYN leaves
            out["none"] = await ask(puncher, PunchRequest(address=there), caller)
            out["self-signed"] = await ask(
                puncher, PunchRequest(address=there, observed=seen(caller, caller, there)), caller
            )
            out["stranger's"] = await ask(
                puncher, PunchRequest(address=there, observed=seen(stranger, caller, there)), caller
            )
            out["another caller's"] = await ask(
                puncher, PunchRequest(address=there, observed=seen(observer, other, there)), caller
            )
            out["elsewhere"] = await ask(
                puncher, PunchRequest(address="81.2.69.99:22", observed=seen(observer, caller, there)), caller
            )
            stale = seen(observer, caller, there, time.time() - 3600)
            out["stale"] = await ask(puncher, PunchRequest(address=there, observed=stale), caller)
            lan = "192.168.1.1:80"
            out["lan"] = await ask(puncher, PunchRequest(address=lan, observed=seen(observer, caller, lan)), caller)
            local = "127.0.0.1:22"
            out["loopback"] = await ask(
                puncher, PunchRequest(address=local, observed=seen(observer, caller, local)), caller
            )
        finally:
            puncher.close()
        # a swarm that lives on one host: the caller's own loopback endpoint (a port nobody listens on) is granted
        home = Puncher(None, observer, lambda: (f"{observer.peer_id}@127.0.0.1:4001",), None)  # type: ignore[arg-type]
        home.port, home.endpoint = bound_socket(), "127.0.0.1:5000"
        try:
            mine = f"127.0.0.1:{bound_socket().getsockname()[1]}"
            out["own"] = await ask(home, PunchRequest(address=mine, observed=seen(observer, caller, mine)), caller)
        finally:
            home.close()
        return out

    out = asyncio.run(run())
    assert "no observation" in out["none"]
    assert "not one of this peer's observers" in out["self-signed"] and "not one of" in out["stranger's"]
    assert "another caller" in out["another caller's"]
    assert "saw you at 81.2.69.160:6000" in out["elsewhere"]
    assert "too old" in out["stale"]
    assert "a private endpoint" in out["lan"] and "a loopback endpoint" in out["loopback"]
    assert out["own"] == "punching toward 127.0.0.1:5000"


@pytest.mark.parametrize(
    "answers, ok, symmetric",
    [
        ({"a": ["1.2.3.4:100"], "b": ["1.2.3.4:100"]}, True, False),  # one mapping for both: punch-able
        ({"a": ["1.2.3.4:100"], "b": ["1.2.3.4:200"]}, False, True),  # two ports: symmetric, no punches
        ({"a": ["1.2.3.4:100"], "b": [None, None]}, False, False),  # one answer of two, twice: cannot tell
        ({"a": ["1.2.3.4:100"], "b": [None, "1.2.3.4:200"]}, False, True),  # the second answers when asked again
        ({"a": ["1.2.3.4:100"]}, True, False),  # one relay, one observer: all it can know
    ],
)
def test_a_peer_offers_punches_only_when_its_observers_agree(monkeypatch, answers, ok, symmetric):
    """``Puncher.refresh``: two observers where two are known; a peer that went by one answer while behind a
    symmetric NAT offered punches its callers could not get through (a CI run of test_nat_swarm)."""
    import peers.rpc.punch_server as punch_server
    from peers.rpc.punch_server import Puncher

    left = {k: list(v) for k, v in answers.items()}
    asked: list[str] = []

    async def observe(port, observer, creds, tls, timeout):
        asked.append(observer)
        address = left[observer].pop(0) if len(left[observer]) > 1 else left[observer][0]
        if address is None:
            raise DirectDialError(f"{observer} did not answer")
        return type("Reply", (), {"address": address})()

    monkeypatch.setattr(punch_server, "observe", observe)
    puncher = Puncher(None, _peer_key(), lambda: tuple(answers), None)  # type: ignore[arg-type]
    assert asyncio.run(puncher.refresh()) is ok
    assert puncher.symmetric is symmetric
    assert (puncher.endpoint is not None) is ok
    assert asked.count("a") == 1  # an observer that answered is not asked again
