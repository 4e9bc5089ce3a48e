"""Which transport a call takes, decided in one place (``choose_transport``), and the channels that carry it.

- ``POOLED``: compute calls over the direct data plane reuse a few kept-open TCP connections per server
  (``swarm.compute_loop``: requests back to back, answered in order).
- ``DIRECT``: other streams (inference sessions, bandwidth probes) over a fresh TCP connection.
- ``UNARY``: a libp2p request-reply, for a message that fits one p2pd frame, and for control calls (info).
- ``STREAM``: a libp2p stream, for anything larger and for inference sessions.

The direct data plane is TLS bound to both ends' identities, so ``direct="auto"`` takes it toward every server that
offers one, judged by the path actually dialled: a server whose direct address cannot be reached, or answers as
another peer, is called over libp2p for a while (``Remote``). ``"always"`` never falls back; ``"never"`` is libp2p
only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import closing
from enum import StrEnum
from typing import Protocol

from hivemind.p2p import P2P, P2PHandlerError, PeerID

from swarm import wire
from swarm.config import DirectPolicy
from swarm.hop import Hop
from swarm.protocol import RPC_FORWARD, RPC_FORWARD_STREAM, RPC_INFO, RPC_PUNCH


class Transport(StrEnum):
    POOLED = "pooled"
    DIRECT = "direct"
    UNARY = "unary"
    STREAM = "stream"


def use_direct(hop: Hop, policy: DirectPolicy, reachable: bool = True) -> bool:
    """``reachable``: the last dial of ``hop``'s direct address did not fail (``auto`` falls back when it did)."""
    if not (hop.direct or hop.punch_via) or policy == "never":
        return False
    return policy == "always" or reachable


def choose_transport(
    hop: Hop, rpc: str, size: int, frames: int, policy: DirectPolicy, reachable: bool = True
) -> Transport:
    """The transport of one call of ``rpc`` to ``hop`` carrying ``frames`` frames of ``size`` bytes in all."""
    if rpc in (RPC_INFO, RPC_PUNCH):
        return Transport.UNARY  # control plane: always libp2p (works through NATs)
    if use_direct(hop, policy, reachable) and (hop.direct or rpc != RPC_FORWARD):
        # kept-open compute connections are pooled by address; a peer behind NAT punches one per stream
        return Transport.POOLED if rpc == RPC_FORWARD else Transport.DIRECT
    if rpc == RPC_FORWARD and frames == 1 and size < wire.FRAME_BYTES:
        return Transport.UNARY
    return Transport.STREAM


def stream_rpc(rpc: str) -> str:
    """The libp2p handler that streams ``rpc`` (forward requests have a unary and a streamed handler)."""
    return RPC_FORWARD_STREAM if rpc == RPC_FORWARD else rpc


class Channel(Protocol):
    """One open RPC stream: frames out, complete messages in."""

    decoder: wire.Decoder  # counts the bytes received (traffic accounting)

    async def send(self, frames: list[wire.Frame]) -> None: ...

    def write(self, frames: list[wire.Frame]) -> None:
        """Hand ``frames`` to the transport now, without waiting (``flush`` waits until they left): a sender on the
        step path writes before it does anything else."""

    async def flush(self) -> None:
        """Wait until what was sent left this process (a sender that must not buffer without bound waits here)."""

    async def receive(self) -> wire.Message | None: ...

    def close(self) -> None: ...


class P2PChannel:
    """A libp2p stream through hivemind's p2pd."""

    def __init__(self, max_bytes: int) -> None:
        self.decoder = wire.Decoder(max_bytes)
        self._outbox: asyncio.Queue[wire.Frame | None] = asyncio.Queue()
        self._responses: AsyncIterator[wire.Frame] | None = None

    @classmethod
    async def open(cls, p2p: P2P, peer: PeerID, rpc: str, max_bytes: int) -> P2PChannel:
        channel = cls(max_bytes)
        channel._responses = await _iterate(p2p, peer, rpc, channel._requests())
        return channel

    async def _requests(self) -> AsyncIterator[wire.Frame]:
        while (frame := await self._outbox.get()) is not None:
            yield frame
            self._outbox.task_done()  # hivemind asks for the next frame once this one was written

    async def send(self, frames: list[wire.Frame]) -> None:
        self.write(frames)

    def write(self, frames: list[wire.Frame]) -> None:
        for frame in frames:
            self._outbox.put_nowait(frame)

    async def flush(self) -> None:
        await self._outbox.join()

    async def receive(self) -> wire.Message | None:
        assert self._responses is not None
        return await wire.read_message(self._responses, self.decoder)

    def close(self) -> None:
        self._outbox.put_nowait(None)


async def _iterate(p2p: P2P, peer: PeerID, rpc: str, requests: AsyncIterator[wire.Frame]) -> AsyncIterator[wire.Frame]:
    """hivemind's ``iterate_protobuf_handler``, except at the end of the stream: hivemind's then waits for its
    writer, which waits for our next frame, so a stream that died while this side had nothing to send (an idle push
    link whose relay died) never ended, and the next session's first push went into it and was lost. Here the
    stream's end ends the replies at once and stops the writer."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, rpc)

    async def write() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    writing = asyncio.create_task(write())

    async def read() -> AsyncIterator[wire.Frame]:
        with closing(writer):
            try:
                while True:
                    try:
                        response, err = await P2P.receive_protobuf(wire.Frame, reader)
                    except asyncio.IncompleteReadError:  # the stream ended
                        return
                    if err is not None:
                        raise P2PHandlerError(f"handler {rpc} at {peer} failed: {err.message}")
                    assert isinstance(response, wire.Frame)
                    yield response
            finally:
                writing.cancel()
                if writing.done() and not writing.cancelled():
                    writing.exception()  # retrieved: a write that failed on a dead stream is not news

    return read()


async def unary(p2p: P2P, peer: PeerID, rpc: str, frame: wire.Frame) -> wire.Frame:
    reply = await p2p.call_protobuf_handler(peer, rpc, frame, wire.Frame)
    assert isinstance(reply, wire.Frame)  # hivemind's call is untyped: check what it returned
    return reply
