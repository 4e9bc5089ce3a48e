"""Serves the servicer's streaming RPCs over libp2p, speaking hivemind's stream framing (so hivemind's client calls
them unchanged) with our own reader and writer (``peers.rpc.framing``).

Why not hivemind's ``add_protobuf_handler(stream_input=True)``: its reader reads a frame's declared length and then
buffers that many bytes whole, whatever the length (an outsider's unfinished 4 GiB frame is held, before any
membership check), prefetches five frames into a queue nobody counts, and writes replies with no deadline. Here a
frame's length is capped before reading, every byte held is counted per caller, streams are counted per caller and
in total, and a caller that stops reading loses its stream.

hivemind's framing: one marker byte (0: a message, 1: an error or, empty, the end of the input), an 8-byte
big-endian length, then a serialized protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto.p2pd_pb2 import RPCError

from peers.rpc.framing import Caller, StreamLimits, WriteStalled, close_replies, read_body, write_counted
from peers.serving.limits import CallerContext, Quota
from swarm import wire
from swarm.errors import BadInputError, BusyError

log = logging.getLogger(__name__)
Handler = Callable[[AsyncIterator[wire.Frame], CallerContext], AsyncIterator[wire.Frame]]
MESSAGE, ERROR = b"\x00", b"\x01"
HEADER = 8
MAX_ERROR = 65536  # the end-of-input marker is empty; an error from a caller carries no more than a short text


class P2PStreams:
    def __init__(self, budget: wire.ByteBudget | None, limits: StreamLimits, streams: Quota) -> None:
        self.budget, self.limits, self.streams = budget, limits, streams
        self.refused = 0  # streams turned away at once (over ``streams``)

    async def register(self, p2p: P2P, name: str, handler: Handler) -> None:
        async def serve(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(handler, info, reader, writer)

        await p2p.add_binary_stream_handler(name, serve)

    async def _serve(
        self, handler: Handler, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        caller = info.peer_id.to_base58()
        try:
            self.streams.acquire(caller)
        except BusyError as e:
            self.refused += 1
            with contextlib.suppress(Exception):
                await self._write(writer, ERROR, RPCError(message=f"busy: {e}").SerializeToString(), caller)
            writer.close()
            return
        replies = handler(self._frames(reader, caller), Caller(info.peer_id))
        try:
            async for frame in replies:
                await self._write(writer, MESSAGE, frame.SerializeToString(), caller)
        except (WriteStalled, ConnectionError, OSError) as e:
            log.info("stream to a caller ended: %s", e, extra={"peer": caller})
        except Exception as e:  # a handler's own failure (handlers answer refusals themselves): tell the caller
            log.exception("stream handler failed", extra={"peer": caller})
            error = RPCError(message=f"{type(e).__name__}: {e}"[:4096])
            with contextlib.suppress(Exception):
                await self._write(writer, ERROR, error.SerializeToString(), caller)
        finally:
            await close_replies(replies)  # its cleanup (a session's cache room) runs now, not at a collection
            self.streams.release(caller)
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, marker: bytes, data: bytes, caller: str) -> None:
        await write_counted(writer, marker + len(data).to_bytes(HEADER, "big") + data, self.budget, caller, self.limits)

    async def _frames(self, reader: asyncio.StreamReader, caller: str) -> AsyncIterator[wire.Frame]:
        """The caller's frames until its end-of-input marker or a clean end of the stream."""
        while True:
            try:
                marker = await reader.readexactly(1)
            except asyncio.IncompleteReadError:
                return
            try:
                size = int.from_bytes(await reader.readexactly(HEADER), "big")
            except asyncio.IncompleteReadError:
                raise BadInputError("stream ended inside a frame header") from None
            if marker == ERROR:  # the end of the caller's input (hivemind sends an empty RPCError)
                if size > MAX_ERROR:
                    raise BadInputError(f"an end-of-input marker of {size} bytes")
                with contextlib.suppress(asyncio.IncompleteReadError):
                    await reader.readexactly(size)
                return
            if marker != MESSAGE:
                raise BadInputError(f"unknown frame marker {marker!r}")
            yield await read_body(reader, size, self.budget, caller, self.limits)
