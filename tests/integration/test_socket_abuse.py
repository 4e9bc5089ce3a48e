"""Real sockets against a real server's direct port: slow-loris (nothing, or a TLS hello / the first frame byte by
byte), half-open connections, and a connection flood beyond ``--max-connections``. Each is closed by the server (the
flood's extra connections at once), its socket released, and an honest client works afterwards. Outcomes are
asserted, not durations: every wait has a generous bound."""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time

import pytest
import torch

from swarm import wire
from swarm.protocol import RPC_COMPUTE_LOOP, DirectCall, ForwardRequest
from swarm.rpc.direct import TcpChannel, split_address
from tests.helpers.swarms import connect, running_swarm, wait_for

pytestmark = pytest.mark.slow  # handshake timeouts on real sockets: the full suite runs it, the fast loop not

MAX_CONNECTIONS = 16
HANDSHAKE_S = 1.5
BOUND = 30.0  # seconds: far beyond the handshake timeout, so only a server that never closes fails


@pytest.fixture(scope="module")
def guarded(tiny_models):
    folder = str(tiny_models["llama"])
    with running_swarm(
        folder, ["0:4"], "--max-connections", str(MAX_CONNECTIONS), "--handshake-timeout", str(HANDSHAKE_S)
    ) as swarm:
        client = connect(folder, swarm)
        try:
            with torch.no_grad():
                client(torch.tensor([[1, 2]]))
            hop = client.route[0]
            assert hop.direct
            yield client, hop
        finally:
            client.close()


def _closed_by_server(sock: socket.socket, deadline: float, trickle: bytes = b"") -> str | None:
    """Wait (sending ``trickle`` a byte at a time, slowly) until the server closes ``sock``: "reset" (an abort),
    "closed" (an orderly close), or None if it never did."""
    sock.setblocking(False)
    while time.monotonic() < deadline:
        if trickle:
            try:
                sock.send(trickle[:1])
            except (BrokenPipeError, ConnectionResetError):
                return "reset"
            except ssl.SSLWantWriteError:
                pass
            trickle = trickle[1:]
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable:
            try:
                if sock.recv(65536) == b"":
                    return "closed"
            except (ConnectionResetError, BrokenPipeError):
                return "reset"
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                return "closed"
            except (BlockingIOError, ssl.SSLWantReadError):
                pass
    return None


def _client_hello() -> bytes:
    """The bytes of a real TLS 1.3 ClientHello."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def _tls(address: tuple[str, int]) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx.wrap_socket(socket.create_connection(address, timeout=BOUND))


def _server_sockets_open(port: int, client_ports: set[int]) -> list[int]:
    """Client ports whose server-side socket (local ``port``) is still open: ESTABLISHED or CLOSE_WAIT."""
    still = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote, state = fields[1], fields[2], fields[3]
                if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) in client_ports:
                    if state in ("01", "08"):
                        still.append(int(remote.rsplit(":", 1)[1], 16))
    return still


def _honest_direct_call(client, hop) -> None:
    """A fresh authenticated compute connection answers a real forward request."""
    conn = client.connection

    async def call():
        channel = await TcpChannel.open(
            hop.direct, hop.peer_id, RPC_COMPUTE_LOOP, 1 << 24, conn.remote.creds, conn.remote.tls, BOUND
        )
        try:
            request = ForwardRequest(start=hop.start, end=hop.end)
            await channel.send(wire.encode(conn.remote.meta(request), {"hidden": torch.zeros(1, 2, 64)}))
            return await channel.receive()
        finally:
            channel.close()

    message = conn.loop.run(call())
    assert message is not None and message[0]["ok"] is True and message[1]["hidden"].shape == (1, 2, 64)
    with torch.no_grad():
        assert client(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)


def test_slow_loris_and_half_open_connections_are_closed(guarded):
    client, hop = guarded
    address = split_address(hop.direct)
    deadline = time.monotonic() + BOUND
    ports: set[int] = set()

    silent = socket.create_connection(address)  # connects, then says nothing
    trickler = socket.create_connection(address)  # a real ClientHello, one byte every 0.2 s
    tls_silent = _tls(address)  # TLS done, then no call
    slow_call = _tls(address)  # TLS done, the call's first frame one byte at a time
    half = _tls(address)  # TLS done, half a frame, then the write side shut
    socks = [silent, trickler, tls_silent, slow_call, half]
    ports = {s.getsockname()[1] for s in socks}
    try:
        call = DirectCall(rpc=RPC_COMPUTE_LOOP, public_key="k", signature="s")
        frame = struct.pack(">I", 100) + wire.encode(call.model_dump(mode="json"))[0].SerializeToString()[:50]
        half.sendall(frame[:30])
        half.shutdown(socket.SHUT_WR)
        assert _closed_by_server(half, deadline) is not None
        assert _closed_by_server(silent, deadline) is not None
        assert _closed_by_server(trickler, deadline, trickle=_client_hello()) is not None
        assert _closed_by_server(tls_silent, deadline) is not None
        assert _closed_by_server(slow_call, deadline, trickle=frame) is not None
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: not _server_sockets_open(address[1], ports), BOUND, "the server to release its sockets")
    _honest_direct_call(client, hop)


def test_connection_flood_is_refused_then_served(guarded):
    client, hop = guarded
    address = split_address(hop.direct)
    flood = [socket.create_connection(address) for _ in range(3 * MAX_CONNECTIONS)]
    ports = {s.getsockname()[1] for s in flood}
    deadline = time.monotonic() + BOUND
    try:
        # every connection is closed: those over the cap at once (before any TLS), those within it at their
        # handshake deadline
        closed = [_closed_by_server(s, deadline) for s in flood]
        assert None not in closed, f"{closed.count(None)} flood connections were never closed"
    finally:
        for s in flood:
            s.close()
    wait_for(lambda: not _server_sockets_open(address[1], ports), BOUND, "the server to release its sockets")
    _honest_direct_call(client, hop)
