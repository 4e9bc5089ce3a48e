"""Hole punching for the direct plane: a TCP connection between two peers that may both be behind NATs, opened by
both at once (TCP simultaneous open), so the data plane does not go through a relay.

A peer behind a NAT cannot be dialled, and p2pd in hivemind's wheel does not punch holes for its own connections.
So the swarm does it for its TLS direct plane: each side learns its endpoint as the internet sees it by asking a
public peer (``observe``, the ``swarm.observe`` RPC of that peer's direct plane, from the very local port it will
punch from), the caller sends its endpoint over the relayed libp2p connection (``swarm.punch``) and gets the
peer's back, and both connect to each other at once from those ports (``simultaneous_open``). Each side's SYN
opens its own NAT to the other; where both NATs keep one mapping per local port (full-cone, restricted and
port-restricted, RFC 4787's endpoint-independent mapping), the SYNs cross and the connection opens; behind a
symmetric NAT the mapping towards the peer is not the one observed and it does not, and the caller stays on the
relayed libp2p path. TLS then runs over the punched connection as over a dialled one: the caller as TLS client,
and the peer proves its identity in its first frame as always (``swarm.rpc.secure``), so a lying observer or peer
costs one failed attempt, nothing else.

The caller also listens on its punching port while it punches: where the caller can be reached there (a public
host, or a full-cone NAT's mapping the observation opened), the peer's own SYNs open the connection, whatever the
peer's NAT or firewall does to the caller's SYNs (a volunteer behind a stateful firewall or a symmetric NAT, calling
a public client back). Only a connection from the peer's address is taken, and TLS still proves who it is. A caller
whose two observers see two ports is behind a symmetric NAT: no peer behind a NAT could reach it, and it goes to the
relay at once. A whole attempt is bounded by ``PUNCH_BUDGET_S``, so one that cannot work leaves the session's
open timeout to the relay (a punch that crossed takes a few round trips)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable

from swarm import wire
from swarm.errors import SwarmError
from swarm.identity import Credentials
from swarm.nat_protocol import DialbackReply, DialbackRequest, ObserveReply
from swarm.protocol import RPC_DIALBACK, RPC_OBSERVE
from swarm.rpc.direct import DirectDialError, TcpChannel, split_address

RETRY_S = 0.05  # a refused connect (the other side's SYN not yet out, or an early RST) is tried again this soon
PUNCH_BUDGET_S = 3.5  # a caller's whole attempt (observe, signal, SYNs, TLS): an open timeout is 5-10 s


def bound_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound to ``port`` on every address (0: any free one), sharable with other sockets on that port
    (one port serves many punched connections, each to a different peer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def parse_observer(text: str) -> tuple[str, str]:
    """``"PEER_ID@host:port"`` as (peer id, address)."""
    peer, _, address = text.partition("@")
    return peer, address


def address_range(endpoint: str) -> str:
    """``loopback``, ``link-local``, ``private`` (RFC 1918, carrier-grade NAT's shared space, other non-global
    ranges) or ``global``: the range of ``endpoint``'s IPv4 address."""
    ip = ipaddress.ip_address(split_address(endpoint)[0])
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    return "global" if ip.is_global else "private"


async def observe(port: int, observer: str, creds: Credentials, tls: ssl.SSLContext, timeout: float) -> ObserveReply:
    """This host's endpoint for local ``port`` as the internet sees it, told by ``observer`` (``PEER_ID@host:port``
    of a public peer's direct plane), with the observer's signed ``Observation`` of it (what a peer asked to punch
    toward it checks). The observer closes first, so no TIME_WAIT holds the port here."""
    peer, address = parse_observer(observer)
    sock = bound_socket(port)
    try:
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, split_address(address))
    except (OSError, TimeoutError) as e:
        sock.close()
        raise DirectDialError(f"observer {address}: {type(e).__name__}: {e}") from None
    channel = await TcpChannel.open(address, peer, RPC_OBSERVE, 4096, creds, tls, timeout, sock=sock)
    try:
        async with asyncio.timeout(timeout):
            message = await channel.receive()
            with contextlib.suppress(Exception):
                await channel.reader.read()  # until the observer closes
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        raise DirectDialError(f"observer {address}: {type(e).__name__}: {e}") from None
    finally:
        channel.close()
    if message is None:
        raise DirectDialError(f"observer {address} said nothing")
    try:
        return ObserveReply.model_validate(message[0])
    except ValueError as e:
        raise DirectDialError(f"observer {address}: not an address: {e}") from None


async def dialback(observer: str, port: int, creds: Credentials, tls: ssl.SSLContext, timeout: float) -> bool:
    """Whether ``observer`` (a public peer's direct plane) opens a TCP connection back to this host's address, as
    it sees it, at ``port``: can the internet reach this host there (``DirectDialError`` if it does not answer)."""
    peer, address = parse_observer(observer)
    channel = await TcpChannel.open(address, peer, RPC_DIALBACK, 4096, creds, tls, timeout)
    try:
        async with asyncio.timeout(timeout + 5.0):  # the observer's own dial takes up to a few seconds
            await channel.send(wire.encode(DialbackRequest(port=port).model_dump(mode="json")))
            message = await channel.receive()
        if message is None:
            raise DirectDialError(f"observer {address} said nothing")
        return DialbackReply.model_validate(message[0]).reached
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        raise DirectDialError(f"observer {address}: {type(e).__name__}: {e}") from None
    finally:
        channel.close()


async def simultaneous_open(port: int, remote: str, timeout: float) -> socket.socket:
    """A TCP connection from local ``port`` to ``remote`` while the other side connects back from there: connects
    again whenever one is refused (the other side's NAT or host answered before its own SYN went out), until
    ``timeout``."""
    loop = asyncio.get_running_loop()
    address = split_address(remote)
    deadline = loop.time() + timeout
    last: BaseException | None = None
    while loop.time() < deadline:
        sock = bound_socket(port)
        try:
            async with asyncio.timeout_at(deadline):
                await loop.sock_connect(sock, address)
            return sock
        except BaseException as e:
            sock.close()
            if not isinstance(e, (OSError, TimeoutError)):
                raise  # cancelled: the caller took the peer's own connection instead
            last = e
            if isinstance(e, TimeoutError):
                break
            await asyncio.sleep(RETRY_S)
    raise DirectDialError(f"no punched connection to {remote} in {timeout:g} s: {type(last).__name__}: {last}")


async def punched(
    peer: str,
    observers: tuple[str, ...],
    rpc: str,
    limit: int,
    signal: Callable[[ObserveReply], Awaitable[str]],
    creds: Credentials,
    tls: ssl.SSLContext,
    timeout: float,
) -> TcpChannel:
    """A direct connection to ``peer``, behind NAT, for ``rpc``: this host's endpoint observed (by up to two of
    ``observers`` at once), sent by ``signal`` (the ``swarm.punch`` call over libp2p, which returns the peer's
    endpoint), punched (or taken as the peer's connection back to this host), then TLS as on any direct connection
    (``DirectDialError`` where any step fails, within ``PUNCH_BUDGET_S``)."""
    budget = min(timeout, PUNCH_BUDGET_S)
    holder = bound_socket()  # keeps this port ours while the observation and the punch use it; listens meanwhile
    port = holder.getsockname()[1]
    try:
        holder.listen(4)  # before the signal: the peer's first SYN may overtake its answer through the relay
        async with asyncio.timeout(budget):
            mine = await _observed(port, observers, creds, tls, budget)
            try:
                theirs = await signal(mine)
            except SwarmError as e:
                raise DirectDialError(f"the peer did not punch: {e}") from None
            sock, reverse = await _connected(holder, port, theirs, budget)
            channel = await TcpChannel.open(theirs, peer, rpc, limit, creds, tls, budget, sock)
            channel.reverse = reverse
            return channel
    except TimeoutError:
        raise DirectDialError(f"no punched connection to {peer} in {budget:g} s") from None
    finally:
        holder.close()


async def _observed(
    port: int, observers: tuple[str, ...], creds: Credentials, tls: ssl.SSLContext, t: float
) -> ObserveReply:
    """This host's endpoint for ``port``, asked of two observers at once where there are two (``DirectDialError``
    where none answers, or where two see two ports: a symmetric NAT, which no punch gets through)."""
    errors: list[str] = []
    for start in range(0, len(observers), 2):
        asked = [observe(port, o, creds, tls, t) for o in observers[start : start + 2]]
        results = await asyncio.gather(*asked, return_exceptions=True)
        replies = [r for r in results if isinstance(r, ObserveReply)]
        seen = {r.address for r in replies}
        errors += [str(r) for r in results if isinstance(r, DirectDialError)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, DirectDialError):
                raise r
        if len(seen) > 1:
            raise DirectDialError(f"this host's NAT maps per destination ({sorted(seen)}): no punching")
        if replies:
            return replies[0]
    raise DirectDialError(f"no observer told this peer its address: {'; '.join(errors) or 'none named'}")


async def _connected(listener: socket.socket, port: int, theirs: str, timeout: float) -> tuple[socket.socket, bool]:
    """The first of: the simultaneous open from ``port`` to ``theirs``, or a connection the peer opened to
    ``listener`` (from its address, any port: a symmetric NAT shows another port than the one it told); and
    whether it was the latter."""
    host = split_address(theirs)[0]
    punch = asyncio.ensure_future(simultaneous_open(port, theirs, timeout))
    accept = asyncio.ensure_future(_accept_from(listener, host))
    chosen: socket.socket | None = None
    try:
        await asyncio.wait((punch, accept), return_when=asyncio.FIRST_COMPLETED)
        if punch.done() and punch.exception() is None:
            chosen = punch.result()
            return chosen, False
        chosen = await accept  # the peer's connection came first, or the SYNs gave up and it may still come
        return chosen, True
    finally:
        for task in (punch, accept):
            task.cancel()
        for extra in await asyncio.gather(punch, accept, return_exceptions=True):
            if isinstance(extra, socket.socket) and extra is not chosen:  # both finished at once
                extra.close()


async def _accept_from(listener: socket.socket, host: str) -> socket.socket:
    """The next connection to ``listener`` from ``host`` (others are closed: TLS would refuse them anyway)."""
    loop = asyncio.get_running_loop()
    while True:
        sock, address = await loop.sock_accept(listener)
        if address[0] == host:
            sock.setblocking(False)
            return sock
        sock.close()
