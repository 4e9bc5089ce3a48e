"""The direct data plane: the same frames as over libp2p, over a TLS connection bound to both ends' identities.

hivemind's p2pd relays every message through two daemons (client p2pd -> server p2pd), which costs ~1 ms per
message and caps bulk transfers at a fraction of TCP speed. Servers therefore also listen on a TCP port of their own
and announce it; clients use it wherever they can reach it (``swarm.rpc.transport``) and fall back to libp2p where
they cannot. It is encrypted and authenticated (``swarm.rpc.secure``), so it is as safe on the internet as libp2p;
libp2p stays the control plane (DHT, discovery, NAT traversal).

Framing: a 4-byte big-endian length, then one serialized ``wire.Frame``. After TLS, the server sends its signed
``DirectHello`` and the client its ``DirectCall`` (which RPC, who calls); the rest is that RPC's stream, exactly as
over libp2p.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from collections.abc import AsyncIterator

from google.protobuf.message import DecodeError
from pydantic import ValidationError

from swarm import wire
from swarm.errors import BadInputError
from swarm.identity import Credentials
from swarm.protocol import DirectCall, DirectHello
from swarm.rpc.secure import client_proof, fingerprint, server_author

MAX_FRAME = 2 * wire.FRAME_BYTES + 65536
_LEN = struct.Struct(">I")


def framed(frame: wire.Frame) -> bytes:
    data = frame.SerializeToString()
    return _LEN.pack(len(data)) + data


def write_frame(writer: asyncio.StreamWriter, frame: wire.Frame) -> None:
    writer.write(framed(frame))


async def read_header(reader: asyncio.StreamReader) -> int | None:
    """The size a frame's header declares, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise BadInputError("stream ended inside a frame header") from None
        return None
    size: int = _LEN.unpack(header)[0]
    return size


async def read_frame(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> wire.Frame | None:
    """The next frame, or None at a clean end of stream; ``BadInputError`` for a stream that ends inside a frame or a
    frame that is not one (its declared size is checked before anything is read into memory)."""
    size = await read_header(reader)
    if size is None:
        return None
    if size > max_frame:
        raise BadInputError(f"frame of {size} bytes exceeds the limit of {max_frame}")
    try:
        return wire.Frame.FromString(await reader.readexactly(size))
    except asyncio.IncompleteReadError as e:
        raise BadInputError(f"stream ended after {len(e.partial)} of a frame's {size} bytes") from None
    except DecodeError as e:
        raise BadInputError(f"malformed frame: {e}") from None


async def frames_of(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> AsyncIterator[wire.Frame]:
    while (frame := await read_frame(reader, max_frame)) is not None:
        yield frame


class DirectDialError(Exception):
    """No authenticated direct connection could be made (unreachable, not TLS, or not the peer we meant to dial):
    the caller may take libp2p instead."""


def split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


class TcpChannel:
    """Client side of one RPC over a direct connection: frames out, complete messages in (many, for a kept-open
    connection)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int) -> None:
        self.reader, self.writer = reader, writer
        self.last_used = 0.0  # monotonic time its last reply completed (kept-open connections)
        self.reverse = False  # punched: opened by the peer's SYNs to this host's listening port (``swarm.rpc.punch``)
        self._frames = frames_of(reader)
        self.decoder = wire.Decoder(max_bytes)

    @classmethod
    async def open(
        cls,
        address: str,
        server: str,
        rpc: str,
        max_bytes: int,
        creds: Credentials,
        tls: ssl.SSLContext,
        timeout: float,
        sock: socket.socket | None = None,
    ) -> TcpChannel:
        """A connection to peer ``server`` at ``address`` for ``rpc``, once the server proved it is ``server``
        (``DirectDialError`` otherwise; nothing of the call is sent before that). ``sock``: a TCP connection to it
        already open (a punched one, ``swarm.rpc.punch``), taken over by TLS."""
        try:
            async with asyncio.timeout(timeout):
                if sock is not None:
                    reader, writer = await asyncio.open_connection(sock=sock, ssl=tls, server_hostname="")
                else:
                    host, port = split_address(address)
                    reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname="")
        except (OSError, ValueError, TimeoutError, ssl.SSLError) as e:
            raise DirectDialError(f"{address}: {type(e).__name__}: {e}") from None
        channel = cls(reader, writer, max_bytes)
        try:
            async with asyncio.timeout(timeout):
                await channel._handshake(server, rpc, creds)
        except BaseException as e:
            channel.close()
            if isinstance(e, Exception):
                raise DirectDialError(f"{address}: {type(e).__name__}: {e}") from None
            raise
        return channel

    async def _handshake(self, server: str, rpc: str, creds: Credentials) -> None:
        ssl_object = self.writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            raise BadInputError("the server presented no certificate")
        fp = fingerprint(der)
        call = DirectCall(
            rpc=rpc, public_key=creds.public_key, signature=client_proof(creds, fp, server), member=creds.member
        )
        for frame in wire.encode(call.model_dump(mode="json")):
            write_frame(self.writer, frame)
        message = await wire.read_message(self._frames, wire.Decoder(8192))
        if message is None:
            raise BadInputError("the server closed the connection before its hello")
        try:
            hello = DirectHello.model_validate(message[0])
        except ValidationError:
            raise BadInputError(f"not a swarm hello: {str(message[0])[:200]}") from None
        author = server_author(hello.public_key, hello.signature, fp)
        if author != server:
            raise BadInputError(f"the server at this address is {author or 'unproven'}, not {server}")

    async def send(self, frames: list[wire.Frame]) -> None:
        """Write ``frames``. A connection the server already closed is not an error here: the server may have said
        why before closing (an inference session that idled out hears ``session_expired``), and that reply waits in
        the read buffer, so ``receive`` tells what happened (the reply, or the end of the stream)."""
        if self.writer.is_closing():
            return
        self.write(frames)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    def write(self, frames: list[wire.Frame]) -> None:
        if not self.writer.is_closing():
            for frame in frames:
                write_frame(self.writer, frame)

    async def flush(self) -> None:
        if not self.writer.is_closing():
            await self.writer.drain()

    async def receive(self) -> wire.Message | None:
        return await wire.read_message(self._frames, self.decoder)

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
