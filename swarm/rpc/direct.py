"""The direct data plane: the same frames as over libp2p, sent over a plain TCP connection.

hivemind's p2pd relays every message through two daemons (client p2pd -> server p2pd), which costs ~1 ms per
message and caps bulk transfers at a fraction of TCP speed. Servers therefore also listen on a plain TCP port and
announce it; clients use it where the path is trusted (loopback and private networks by default, see
``swarm.rpc.transport``) and fall back to libp2p otherwise. libp2p stays the control plane (DHT, discovery, NAT
traversal, encrypted transport on the internet).

Framing: a 4-byte big-endian length, then one serialized ``wire.Frame``. The first frame of a connection names the
RPC in its ``uid`` field; the rest is that RPC's stream, exactly as over libp2p.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

from swarm import wire
from swarm.errors import BadInputError

MAX_FRAME = 2 * wire.FRAME_BYTES + 65536
_LEN = struct.Struct(">I")


def write_frame(writer: asyncio.StreamWriter, frame: wire.Frame) -> None:
    data = frame.SerializeToString()
    writer.write(_LEN.pack(len(data)) + data)


async def read_frame(reader: asyncio.StreamReader) -> wire.Frame | None:
    """The next frame, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    (size,) = _LEN.unpack(header)
    if size > MAX_FRAME:
        raise BadInputError(f"frame of {size} bytes exceeds the limit of {MAX_FRAME}")
    return wire.Frame.FromString(await reader.readexactly(size))


async def frames_of(reader: asyncio.StreamReader) -> AsyncIterator[wire.Frame]:
    while (frame := await read_frame(reader)) is not None:
        yield frame


class TcpChannel:
    """Client side of one RPC over TCP: frames out, complete messages in (many, for a kept-open connection)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int) -> None:
        self.reader, self.writer = reader, writer
        self._frames = frames_of(reader)
        self.decoder = wire.Decoder(max_bytes)

    @classmethod
    async def open(cls, address: str, rpc: str, max_bytes: int) -> TcpChannel:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        channel = cls(reader, writer, max_bytes)
        write_frame(writer, wire.Frame(uid=rpc))
        return channel

    async def send(self, frames: list[wire.Frame]) -> None:
        for frame in frames:
            write_frame(self.writer, frame)
        await self.writer.drain()

    async def receive(self) -> wire.Message | None:
        return await wire.read_message(self._frames, self.decoder)

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
