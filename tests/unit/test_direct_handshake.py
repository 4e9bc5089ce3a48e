"""The direct plane's handshake in one process: a client that sends its TLS ClientHello the instant it connects (as
one on the same event loop always does) still gets through, the server learns the caller's peer id from its proof,
and a caller outside a private swarm, or over its connection cap, hears why."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from peers.rpc.direct_server import DirectLimits, DirectServer
from peers.serving.counters import PeerMetrics
from swarm import wire
from swarm.errors import BusyError, NotMemberError
from swarm.identity import Credentials
from swarm.protocol import RPC_BANDWIDTH, Reply, parse_reply
from swarm.rpc.direct import TcpChannel
from swarm.rpc.secure import client_context


class _Echo:
    """Stands in for the servicer: every handler answers each message with the caller's peer id."""

    compute = SimpleNamespace(metrics=PeerMetrics())  # where the direct server counts its own failures
    budget = wire.ByteBudget(1 << 30, 1 << 28)  # where it counts the bytes it holds for callers

    def __getattr__(self, name: str) -> Any:
        async def handler(frames: AsyncIterator[wire.Frame], context: Any) -> AsyncIterator[wire.Frame]:
            decoder = wire.Decoder()
            async for frame in frames:
                if decoder.feed(frame) is not None:
                    for out in wire.encode({"ok": True, "caller": context.remote_id.to_base58()}):
                        yield out

        return handler


async def _call(port: int, server: Credentials, client: Credentials) -> dict[str, object]:
    channel = await TcpChannel.open(
        f"127.0.0.1:{port}", server.peer_id, RPC_BANDWIDTH, 1 << 20, client, client_context(), 10.0
    )
    try:
        await channel.send(wire.encode({"x": 1}))
        message = await asyncio.wait_for(channel.receive(), 10.0)
        assert message is not None
        return message[0]
    finally:
        channel.close()


def test_same_loop_handshake_names_the_caller_and_enforces_membership_and_caps() -> None:
    server_creds, alice, bob = (Credentials.of(RSAPrivateKey()) for _ in range(3))

    async def scenario() -> None:
        members = {alice.peer_id}
        direct = DirectServer(
            _Echo(),
            server_creds,
            DirectLimits(max_caller_connections=1),  # type: ignore[arg-type]
            lambda caller, token: caller in members,
        )
        port = await direct.start("127.0.0.1", 0)
        try:
            for _ in range(3):  # again and again: the ClientHello always races the server's accept
                assert (await _call(port, server_creds, alice))["caller"] == alice.peer_id
            with pytest.raises(NotMemberError, match="private swarm"):
                parse_reply(await _call(port, server_creds, bob), Reply, "server")
            held = await TcpChannel.open(
                f"127.0.0.1:{port}", server_creds.peer_id, RPC_BANDWIDTH, 1 << 20, alice, client_context(), 10.0
            )
            try:
                await held.send(wire.encode({"x": 1}))
                assert await held.receive() is not None  # answered: the server has counted this connection
                with pytest.raises(BusyError, match="at most 1"):
                    parse_reply(await _call(port, server_creds, alice), Reply, "server")
            finally:
                held.close()
        finally:
            await direct.close()

    asyncio.run(scenario())
