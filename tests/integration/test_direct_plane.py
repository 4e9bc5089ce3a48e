"""The direct data plane is encrypted and bound to both ends' identities: what crosses the wire is TLS (a recording
proxy in the middle sees no plaintext), an address that answers as another peer is refused (``auto`` falls back to
libp2p, ``always`` fails), and a third party who reaches the port runs nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from collections.abc import Callable

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm import wire
from swarm.errors import PeerUnavailableError
from swarm.hop import Hop
from swarm.identity import Credentials
from swarm.protocol import RPC_FORWARD, DirectCall, ForwardRequest
from swarm.rpc.direct import TcpChannel, frames_of, split_address, write_frame
from swarm.rpc.remote import Remote
from swarm.rpc.secure import client_context
from tests.helpers.swarms import connect, running_swarm

HIDDEN = 64


@pytest.fixture(scope="module")
def two_servers(tiny_models):
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:4", "0:4"]) as swarm:
        client = connect(folder, swarm)
        try:
            servers = client.connection.view.servers()
            assert len(servers) == 2 and all(s.direct_address for s in servers)
            yield client, [Hop.of(s) for s in servers]
        finally:
            client.close()


def _remote(client, direct: str = "auto") -> Remote:
    conn = client.connection
    return Remote(conn.remote.p2p, conn.remote.creds, direct)  # type: ignore[arg-type]


def _forward(client, remote: Remote, hop: Hop, hidden: torch.Tensor) -> torch.Tensor:
    request = ForwardRequest(start=hop.start, end=hop.end)
    return client.connection.loop.run(remote.compute(hop, request, {"hidden": hidden}, 10.0))["hidden"]


async def _recording_proxy(target: str, captured: bytearray) -> tuple[asyncio.Server, str]:
    """A TCP relay that keeps every byte the client sends: what an eavesdropper on the path would see."""
    host, port = split_address(target)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            while data := await src.read(65536):
                if record:
                    captured.extend(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False), return_exceptions=True)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _on_loop(fn: Callable[[], object]) -> None:
    fn()


def test_direct_calls_are_encrypted(two_servers):
    client, hops = two_servers
    loop = client.connection.loop
    hop = hops[0]
    assert hop.direct is not None
    captured = bytearray()
    proxy, address = loop.run(_recording_proxy(hop.direct, captured))
    try:
        hidden = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(1, 4, HIDDEN) / 1000
        remote = _remote(client, "always")
        through_proxy = _forward(client, remote, dataclasses.replace(hop, direct=address), hidden)
        straight = _forward(client, _remote(client, "never"), hop, hidden)  # libp2p, for reference
        assert torch.equal(through_proxy, straight)
        assert captured[:1] == b"\x16"  # a TLS handshake record, not our framing
        plain = hidden.numpy().tobytes()
        assert len(captured) > len(plain) and plain[:64] not in captured and plain[-64:] not in captured
        loop.run(_on_loop(remote.close))
    finally:
        loop.run(_on_loop(proxy.close))  # asyncio objects are closed on their loop's thread, never from another


def test_an_address_answering_as_another_peer_is_refused(two_servers):
    client, (a, b) = two_servers
    hidden = torch.randn(1, 3, HIDDEN)
    impostor = dataclasses.replace(a, direct=b.direct)  # a's record, b's direct address
    strict = _remote(client, "always")
    with pytest.raises(PeerUnavailableError, match=f"is {b.peer_id}, not {a.peer_id}"):
        _forward(client, strict, impostor, hidden)
    auto = _remote(client, "auto")
    out = _forward(client, auto, impostor, hidden)  # auto: the path failed, libp2p to the right peer
    assert torch.equal(out, _forward(client, _remote(client, "never"), a, hidden))
    assert b.direct in auto._unreachable


async def _tls_open(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = split_address(address)
    return await asyncio.open_connection(host, port, ssl=client_context(), server_hostname="")


def test_a_third_party_runs_nothing(two_servers):
    client, (a, _) = two_servers
    loop = client.connection.loop
    assert a.direct is not None
    address = a.direct

    async def plaintext() -> bytes:
        """The old unencrypted framing: the server wants TLS and drops it."""
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        write_frame(writer, wire.Frame(uid=RPC_FORWARD))
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), 15)
        except ConnectionError:
            return b""
        finally:
            writer.close()

    answer = loop.run(plaintext())  # read() returned: the server closed the connection
    assert b"ok" not in answer and b"hidden" not in answer  # at most a TLS alert, never a reply

    async def forged(public_key: str, signature: str) -> dict[str, object]:
        """TLS, then a call whose identity proof does not hold."""
        reader, writer = await _tls_open(address)
        try:
            call = DirectCall(rpc=RPC_FORWARD, public_key=public_key, signature=signature)
            for frame in wire.encode(call.model_dump(mode="json")):
                write_frame(writer, frame)
            await writer.drain()
            messages = []
            decoder = wire.Decoder(1 << 20)
            async for frame in frames_of(reader):
                message = decoder.feed(frame)
                if message is not None:
                    messages.append(message[0])
            return messages[-1]  # the hello, then an error; then the server closes
        finally:
            writer.close()

    stranger = Credentials.of(RSAPrivateKey())
    reply = loop.run(forged(stranger.public_key, stranger.sign(b"something else")))
    assert reply["ok"] is False and "identity proof does not hold" in str(reply["error"])
    reply = loop.run(forged(stranger.public_key, "not base64"))
    assert reply["ok"] is False

    # a caller with a key of its own is a caller like any other (and is known by its peer id)
    async def honest() -> torch.Tensor:
        channel = await TcpChannel.open(address, a.peer_id, RPC_FORWARD, 1 << 24, stranger, client_context(), 10.0)
        try:
            request = ForwardRequest(start=a.start, end=a.end)
            await channel.send(wire.encode(request.model_dump(mode="json"), {"hidden": torch.ones(1, 2, HIDDEN)}))
            message = await channel.receive()
            assert message is not None and message[0].get("ok") is True, message
            return message[1]["hidden"]
        finally:
            channel.close()

    assert loop.run(honest()).shape == (1, 2, HIDDEN)
    with pytest.raises(ssl.SSLError):
        loop.run(_tls_plain_context(address))


async def _tls_plain_context(address: str) -> None:
    """A client that insists on verifying a CA chain cannot even connect: the certificate is self-signed."""
    host, port = split_address(address)
    _, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context(), server_hostname="x")
    writer.close()
