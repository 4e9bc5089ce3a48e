"""How a server reads and writes its streams on both planes (libp2p and the direct TLS plane), with every byte it
holds for a caller counted where it is held and every wait bounded.

Reading: a frame's declared length is capped before anything is read, and the frame's bytes count against the
caller's and the server's ``wire.ByteBudget`` from the moment its header arrives (so an unfinished frame, which the
transport buffers, is counted too); the rest of a frame must arrive within ``read_timeout`` of its header.

Writing: a reply's bytes count against the same budget until the transport took them (``drain``), which must happen
within ``write_timeout``: a caller that stops reading loses its stream (``WriteStalled``), and with it its session
and reservations, at once. Replies are counted without a limit check (they exist already; refusing to send one
would not free it), so a caller whose replies pile up is refused its next request instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from peers.serving.limits import PeerIdLike, StreamStalled
from swarm import wire
from swarm.errors import BadInputError
from swarm.rpc.direct import MAX_FRAME


@dataclass(frozen=True)
class Caller:
    """What a handler learns of its caller on either plane: the same ``remote_id`` a libp2p ``P2PContext`` carries."""

    remote_id: PeerIdLike


@dataclass(frozen=True)
class StreamLimits:
    max_frame: int = MAX_FRAME
    read_timeout: float = 60.0  # the rest of a frame after its header (``Timing.message_timeout``)
    write_timeout: float = 30.0  # a reply must be taken by the transport this soon (``Timing.write_timeout``)


async def close_replies(replies: AsyncIterator[wire.Frame]) -> None:
    """End a handler's reply generator now, so its cleanup (a session's cache room, its buffers) runs at once rather
    than when a garbage collection finds it."""
    aclose = getattr(replies, "aclose", None)
    if aclose is not None:
        await aclose()


class WriteStalled(Exception):
    """The caller stopped reading: a reply was not taken within the write deadline."""


async def read_body(
    reader: asyncio.StreamReader, size: int, budget: wire.ByteBudget | None, caller: str, limits: StreamLimits
) -> wire.Frame:
    """The frame of ``size`` bytes that follows a header just read, counted in ``budget`` while it arrives."""
    if size > limits.max_frame:
        raise BadInputError(f"frame of {size} bytes exceeds the limit of {limits.max_frame}")
    if budget is not None:
        budget.take(size, caller)
    try:
        async with asyncio.timeout(limits.read_timeout):
            data = await reader.readexactly(size)
    except TimeoutError:
        raise StreamStalled(limits.read_timeout) from None
    except asyncio.IncompleteReadError as e:
        raise BadInputError(f"stream ended after {len(e.partial)} of a frame's {size} bytes") from None
    finally:
        if budget is not None:
            budget.give(size, caller)  # the decoder counts the frame from here (``wire.Decoder``)
    try:
        return wire.Frame.FromString(data)
    except DecodeError as e:
        raise BadInputError(f"malformed frame: {e}") from None


async def write_counted(
    writer: asyncio.StreamWriter, data: bytes, budget: wire.ByteBudget | None, caller: str, limits: StreamLimits
) -> None:
    """Write ``data`` and wait until the transport took it, counting it in ``budget`` meanwhile."""
    if budget is not None:
        budget.hold(len(data), caller)  # held already: counted, never refused (see the module's docstring)
    try:
        writer.write(data)
        async with asyncio.timeout(limits.write_timeout):
            await writer.drain()
    except TimeoutError:
        raise WriteStalled(f"the caller read nothing for {limits.write_timeout:g} s") from None
    finally:
        if budget is not None:
            budget.give(len(data), caller)
