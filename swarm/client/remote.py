"""Calls to one server: forward/backward (unary or streamed by size), the inference stream, and info.

Transport failures become ``PeerUnavailableError``; error replies become the error class the server named. Every
call has a timeout."""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm import wire
from swarm.client.routing import Hop
from swarm.errors import PeerUnavailableError, SwarmError, error_from_code
from swarm.protocol import PROTOCOL_VERSION, RPC_FORWARD, RPC_FORWARD_STREAM, RPC_INFERENCE, RPC_INFO, Reply

log = logging.getLogger(__name__)


def _tag(e: SwarmError, peer_id: str) -> SwarmError:
    e.peer_id = peer_id
    return e


def _check(meta: dict, peer_id: str) -> None:
    try:
        reply = Reply.model_validate(meta)
    except ValueError as e:
        raise _tag(PeerUnavailableError(f"peer {peer_id} sent a malformed reply: {e}"), peer_id) from None
    if not reply.ok:
        raise _tag(error_from_code(reply.error_code or "swarm_error", f"peer {peer_id}: {reply.error}"), peer_id)


class Remote:
    """One client's connection state: its P2P replica and the peers it has dialled."""

    def __init__(self, p2p: P2P) -> None:
        self.p2p = p2p
        self._dialled: set[str] = set()

    async def _peer(self, hop: Hop) -> PeerID:
        peer = PeerID.from_base58(hop.peer_id)
        if hop.peer_id not in self._dialled and hop.maddrs:
            try:
                await self.p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in hop.maddrs])
            except Exception as e:
                raise _tag(PeerUnavailableError(f"cannot reach peer {hop.peer_id}: {e}"), hop.peer_id) from None
            self._dialled.add(hop.peer_id)
        return peer

    async def compute(self, hop: Hop, meta: dict, tensors: dict, timeout: float) -> dict:
        frames = wire.encode(dict(meta, protocol_version=PROTOCOL_VERSION), tensors)
        try:
            peer = await self._peer(hop)
            if len(frames) == 1 and frames[0].ByteSize() < wire.FRAME_BYTES:
                reply = await asyncio.wait_for(
                    self.p2p.call_protobuf_handler(peer, RPC_FORWARD, frames[0], wire.Frame), timeout
                )
                meta_out, out = wire.decode([reply])
            else:
                meta_out, out = await asyncio.wait_for(self._stream_call(peer, frames), timeout)
        except SwarmError as e:
            raise _tag(e, hop.peer_id) from None
        except Exception as e:
            self._dialled.discard(hop.peer_id)
            raise _tag(
                PeerUnavailableError(f"peer {hop.peer_id} failed: {type(e).__name__}: {e}"), hop.peer_id
            ) from None
        _check(meta_out, hop.peer_id)
        return out

    async def _stream_call(self, peer: PeerID, frames: list[wire.Frame]):
        responses = await self.p2p.iterate_protobuf_handler(peer, RPC_FORWARD_STREAM, frames, wire.Frame)
        message = await wire.read_message(responses, wire.Decoder())
        if message is None:
            raise PeerUnavailableError("stream closed without a reply")
        return message

    async def info(self, hop: Hop, timeout: float) -> dict:
        try:
            peer = await self._peer(hop)
            frame = wire.encode({"protocol_version": PROTOCOL_VERSION})[0]
            reply = await asyncio.wait_for(self.p2p.call_protobuf_handler(peer, RPC_INFO, frame, wire.Frame), timeout)
        except Exception as e:
            raise _tag(
                PeerUnavailableError(f"peer {hop.peer_id} failed: {type(e).__name__}: {e}"), hop.peer_id
            ) from None
        meta, _ = wire.decode([reply])
        _check(meta, hop.peer_id)
        return meta["stats"]

    async def open_stream(self, hop: Hop) -> InferenceStream:
        stream = InferenceStream(self, hop)
        await stream.start()
        return stream


class InferenceStream:
    """One open inference session on one server: a bidirectional stream, one message group per step."""

    def __init__(self, remote: Remote, hop: Hop) -> None:
        self.remote = remote
        self.hop = hop
        self._outbox: asyncio.Queue[wire.Frame | None] = asyncio.Queue()
        self._responses = None
        self._decoder = wire.Decoder()
        self.closed = False

    async def _requests(self):
        while (frame := await self._outbox.get()) is not None:
            yield frame

    async def start(self) -> None:
        try:
            peer = await self.remote._peer(self.hop)
            self._responses = await self.remote.p2p.iterate_protobuf_handler(
                peer, RPC_INFERENCE, self._requests(), wire.Frame
            )
        except SwarmError:
            raise
        except Exception as e:
            raise _tag(
                PeerUnavailableError(f"peer {self.hop.peer_id}: cannot open a session: {e}"), self.hop.peer_id
            ) from None

    async def exchange(self, meta: dict, tensors: dict, timeout: float) -> dict:
        for frame in wire.encode(meta, tensors):
            self._outbox.put_nowait(frame)
        try:
            message = await asyncio.wait_for(wire.read_message(self._responses, self._decoder), timeout)
        except Exception as e:
            self.closed = True
            raise _tag(
                PeerUnavailableError(f"peer {self.hop.peer_id} failed: {type(e).__name__}: {e}"), self.hop.peer_id
            ) from None
        if message is None:
            self.closed = True
            raise _tag(PeerUnavailableError(f"peer {self.hop.peer_id} closed the session"), self.hop.peer_id)
        meta_out, out = message
        try:
            _check(meta_out, self.hop.peer_id)
        except SwarmError:
            self.closed = True  # the server ends a session at its first error
            raise
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._outbox.put_nowait(None)
