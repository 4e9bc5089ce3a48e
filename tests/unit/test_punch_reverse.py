"""A caller that can be reached takes the peer's own connection (``swarm.rpc.punch._connected``): while its SYNs are
refused, a connection the peer opens to its listening punch port wins, from the peer's address only. On loopback:
the SYNs toward a port nobody listens on are refused every time, as a filtering NAT's would be dropped."""

from __future__ import annotations

import asyncio
import socket

from swarm.rpc.punch import _connected, bound_socket


def _refusing_port() -> int:
    """A port on loopback that nobody listens on (bound and closed)."""
    sock = bound_socket()
    port: int = sock.getsockname()[1]
    sock.close()
    return port


async def _connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


def test_the_peers_connection_to_the_listening_port_wins_over_refused_syns() -> None:
    async def run() -> tuple[bool, str, str]:
        listener = bound_socket()
        listener.listen(4)
        port = listener.getsockname()[1]
        theirs = f"127.0.0.1:{_refusing_port()}"
        try:
            # a stranger (another address) first: not taken; then the peer, from another port than it told
            stranger = await _connect_from("127.0.0.2", port)
            task = asyncio.ensure_future(_connected(listener, port, theirs, 5.0))
            await asyncio.sleep(0.2)  # the SYNs are refused meanwhile, again and again
            peer = await _connect_from("127.0.0.1", port)
            sock, reverse = await asyncio.wait_for(task, 5.0)
            try:
                return reverse, sock.getpeername()[0], f"{peer.getsockname()}={sock.getpeername()}"
            finally:
                for s in (sock, peer, stranger):
                    s.close()
        finally:
            listener.close()

    reverse, host, pair = asyncio.run(run())
    assert reverse and host == "127.0.0.1", pair
    left, right = pair.split("=")
    assert left == right  # the very connection the peer opened


def test_refused_syns_and_no_connection_end_at_the_deadline() -> None:
    async def run() -> None:
        listener = bound_socket()
        listener.listen(4)
        try:
            async with asyncio.timeout(1.0):
                await _connected(listener, listener.getsockname()[1], f"127.0.0.1:{_refusing_port()}", 0.5)
        finally:
            listener.close()

    try:
        asyncio.run(run())
    except TimeoutError:
        pass
    else:
        raise AssertionError("a punch with no connection either way returned a socket")
