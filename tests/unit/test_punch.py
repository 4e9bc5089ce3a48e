"""Hole punching's parts (``swarm.rpc.punch``): a punch nobody answers ends at its deadline, a peer behind NAT is
reached directly for streams but never pooled, its signal is a control call, and an endpoint is an IPv4 address
and port. The punch itself needs crossing SYNs over a real delay (on loopback a SYN is answered before the other
side's leaves): tests/integration/test_nat_swarm.py punches through emulated NATs for real."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from swarm.hop import Hop
from swarm.protocol import RPC_FORWARD, RPC_INFERENCE, RPC_PUNCH, PunchRequest
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
