"""Calls to one server: forward/backward, the inference stream, and info.

Each call goes over the plain-TCP data plane when the server offers one and the client's policy allows it
(``swarm.direct``), else over libp2p (unary when the message fits one frame, streamed otherwise). Transport failures
become ``PeerUnavailableError``; error replies become the error class the server named. Every call has a timeout,
and every error carries the ``peer_id`` it came from so the retry helper knows whom to ban."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm import wire
from swarm.client.routing import Hop
from swarm.direct import DirectConnection, trusted_path
from swarm.errors import PeerUnavailableError, SwarmError, error_from_code
from swarm.protocol import (
    PROTOCOL_VERSION,
    RPC_BANDWIDTH,
    RPC_COMPUTE_LOOP,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_INFO,
    Reply,
)

log = logging.getLogger(__name__)
POOL_SIZE = 4  # idle compute connections kept per server (a trainer keeps a few micro-batches in flight)


def _tag(e: SwarmError, peer_id: str) -> SwarmError:
    e.peer_id = peer_id
    return e


def _unavailable(peer_id: str, what: str, e: BaseException | None = None) -> SwarmError:
    detail = f": {type(e).__name__}: {e}" if e is not None else ""
    return _tag(PeerUnavailableError(f"peer {peer_id} {what}{detail}"), peer_id)


def _check(meta: dict, peer_id: str) -> None:
    try:
        reply = Reply.model_validate(meta)
    except ValueError as e:
        raise _unavailable(peer_id, "sent a malformed reply", e) from None
    if not reply.ok:
        raise _tag(error_from_code(reply.error_code or "swarm_error", f"peer {peer_id}: {reply.error}"), peer_id)


async def _aiter(frames: list[wire.Frame]):
    for frame in frames:
        yield frame


class Remote:
    """One client's transport state: its P2P replica, the peers it has dialled, and its direct-TCP policy."""

    def __init__(self, p2p: P2P, direct: str = "auto") -> None:
        self.p2p = p2p
        self.direct = direct
        self._dialled: set[str] = set()
        self.traffic: Counter[str] = Counter()  # sent_bytes / received_bytes over every message, all transports
        self._idle: dict[str, list[DirectConnection]] = {}  # direct address -> kept-open compute connections

    def use_direct(self, hop: Hop) -> bool:
        if not hop.direct or self.direct == "never":
            return False
        return self.direct == "always" or trusted_path(hop.direct)

    async def _peer(self, hop: Hop) -> PeerID:
        peer = PeerID.from_base58(hop.peer_id)
        if hop.peer_id not in self._dialled and hop.maddrs:
            try:
                await self.p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in hop.maddrs])
            except Exception as e:
                raise _unavailable(hop.peer_id, "cannot be reached", e) from None
            self._dialled.add(hop.peer_id)
        return peer

    async def compute(self, hop: Hop, meta: dict, tensors: dict, timeout: float) -> dict:
        frames = wire.encode(dict(meta, protocol_version=PROTOCOL_VERSION), tensors)
        self.traffic["sent_bytes"] += wire.encoded_size(frames)
        try:
            message = await asyncio.wait_for(self._exchange_once(hop, frames), timeout)
        except SwarmError as e:
            raise _tag(e, hop.peer_id) from None
        except Exception as e:
            self._dialled.discard(hop.peer_id)
            raise _unavailable(hop.peer_id, "failed", e) from None
        if message is None:
            raise _unavailable(hop.peer_id, "closed the call without a reply")
        _check(message[0], hop.peer_id)
        return message[1]

    async def broadcast(self, hops: list[Hop], meta: dict, timeout: float) -> None:
        """The same small request to many servers at once, best effort (notices: a step began, a client left)."""
        await asyncio.gather(*(self.compute(h, meta, {}, timeout) for h in hops), return_exceptions=True)

    async def send_payload(self, hop: Hop, nbytes: int, timeout: float) -> float:
        """Seconds to send ``nbytes`` to a peer and hear it arrived, over the path real traffic would take."""
        frames = wire.encode({"protocol_version": PROTOCOL_VERSION}, {"payload": torch.zeros(nbytes // 4)})
        t0 = time.perf_counter()
        try:
            message = await asyncio.wait_for(self._exchange_once(hop, frames, RPC_BANDWIDTH, streamed=True), timeout)
        except Exception as e:
            raise _unavailable(hop.peer_id, "failed the bandwidth probe", e) from None
        if message is None:
            raise _unavailable(hop.peer_id, "closed the bandwidth probe")
        _check(message[0], hop.peer_id)
        return time.perf_counter() - t0

    async def _exchange_once(self, hop: Hop, frames: list[wire.Frame], rpc: str = RPC_FORWARD, streamed=False):
        decoder = wire.Decoder()
        try:
            if self.use_direct(hop) and rpc == RPC_FORWARD:
                return await self._pooled_exchange(hop.direct, frames, decoder)
            if self.use_direct(hop):
                conn = await DirectConnection.open(hop.direct, rpc)
                try:
                    await conn.send(frames)
                    return await wire.read_message(conn.responses, decoder)
                finally:
                    conn.close()
            peer = await self._peer(hop)
            if not streamed and len(frames) == 1 and frames[0].ByteSize() < wire.FRAME_BYTES:
                reply = await self.p2p.call_protobuf_handler(peer, rpc, frames[0], wire.Frame)
                message = decoder.feed(reply)
                if message is None:
                    raise _unavailable(hop.peer_id, "sent a reply that ends before all its tensors")
                return message
            stream_rpc = RPC_FORWARD_STREAM if rpc == RPC_FORWARD else rpc
            responses = await self.p2p.iterate_protobuf_handler(peer, stream_rpc, _aiter(frames), wire.Frame)
            return await wire.read_message(responses, decoder)
        finally:
            self.traffic["received_bytes"] += decoder.total_bytes

    async def _pooled_exchange(self, address: str, frames: list[wire.Frame], decoder: wire.Decoder):
        """One compute call over an idle kept-open connection to ``address`` (or a new one); the connection goes
        back to the pool only after a complete reply, so a broken or abandoned one is never reused."""
        idle = self._idle.setdefault(address, [])
        conn = idle.pop() if idle else await DirectConnection.open(address, RPC_COMPUTE_LOOP)
        try:
            await conn.send(frames)
            message = await wire.read_message(conn.responses, conn.decoder)
        except BaseException:
            conn.close()
            raise
        decoder.total_bytes += conn.decoder.total_bytes
        conn.decoder.total_bytes = 0
        if message is None:
            conn.close()
        elif len(idle) < POOL_SIZE:
            idle.append(conn)
        else:
            conn.close()
        return message

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def info(self, hop: Hop, timeout: float) -> dict:
        try:
            peer = await self._peer(hop)
            frame = wire.encode({"protocol_version": PROTOCOL_VERSION})[0]
            reply = await asyncio.wait_for(self.p2p.call_protobuf_handler(peer, RPC_INFO, frame, wire.Frame), timeout)
        except SwarmError:
            raise
        except Exception as e:
            raise _unavailable(hop.peer_id, "failed", e) from None
        meta, _ = wire.decode([reply])
        _check(meta, hop.peer_id)
        return meta["stats"]

    async def open_stream(self, hop: Hop) -> InferenceStream:
        stream = InferenceStream(self, hop)
        try:
            await stream.start()
        except SwarmError:
            raise
        except Exception as e:
            raise _unavailable(hop.peer_id, "cannot open a session", e) from None
        return stream


class InferenceStream:
    """One open inference session on one server: a bidirectional stream, one message group per step."""

    def __init__(self, remote: Remote, hop: Hop) -> None:
        self.remote = remote
        self.hop = hop
        self._decoder = wire.Decoder()
        self._responses = None
        self._direct: DirectConnection | None = None
        self._outbox: asyncio.Queue[wire.Frame | None] | None = None
        self.closed = False

    async def start(self) -> None:
        if self.remote.use_direct(self.hop):
            self._direct = await DirectConnection.open(self.hop.direct, RPC_INFERENCE)
            self._responses = self._direct.responses
            return
        self._outbox = asyncio.Queue()
        peer = await self.remote._peer(self.hop)
        self._responses = await self.remote.p2p.iterate_protobuf_handler(
            peer, RPC_INFERENCE, self._requests(), wire.Frame
        )

    async def _requests(self):
        while (frame := await self._outbox.get()) is not None:
            yield frame

    async def exchange(self, meta: dict, tensors: dict, timeout: float) -> dict:
        """Send one step and wait for its reply."""
        try:
            frames = wire.encode(meta, tensors)
            self.remote.traffic["sent_bytes"] += wire.encoded_size(frames)
            received = self._decoder.total_bytes
            if self._direct is not None:
                await self._direct.send(frames)
            else:
                for frame in frames:
                    self._outbox.put_nowait(frame)
            message = await asyncio.wait_for(wire.read_message(self._responses, self._decoder), timeout)
            self.remote.traffic["received_bytes"] += self._decoder.total_bytes - received
        except Exception as e:
            self.close()
            raise _unavailable(self.hop.peer_id, "failed", e) from None
        if message is None:
            self.close()
            raise _unavailable(self.hop.peer_id, "closed the session")
        try:
            _check(message[0], self.hop.peer_id)
        except SwarmError:
            self.close()  # the server ends a session at its first error
            raise
        return message[1]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._direct is not None:
                self._direct.close()
            elif self._outbox is not None:
                self._outbox.put_nowait(None)
