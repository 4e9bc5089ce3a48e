"""Typed calls to one server: compute (forward, backward, release, state, step notices), the inference stream,
bandwidth probes and info.

Every call encodes a typed request, goes over the transport ``choose_transport`` picks, and parses the typed reply.
Transport failures (connection refused or dropped, timeout, malformed reply) become ``PeerUnavailableError``; error
replies become the error class the server named. Every call has a timeout, and every error carries the ``peer_id``
it came from, so the retry helper knows whom to ban."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter

import torch
from hivemind.p2p import P2P, PeerID

from swarm import wire
from swarm.codecs import ACTIVATIONS, Codec, choose_codec
from swarm.config import DirectPolicy
from swarm.errors import PeerUnavailableError, SwarmError
from swarm.hop import Hop
from swarm.identity import Credentials
from swarm.nat_protocol import ObserveReply, PunchReply, PunchRequest
from swarm.protocol import (
    RPC_BANDWIDTH,
    RPC_COMPUTE_LOOP,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFO,
    RPC_PUNCH,
    BackwardRequest,
    BandwidthProbe,
    BandwidthReply,
    ForwardRequest,
    InfoReply,
    InfoRequest,
    R,
    ReleaseRequest,
    Reply,
    Request,
    StateReply,
    StateRequest,
    StepNotice,
    parse_reply,
)
from swarm.relay import CIRCUIT, dial_addr
from swarm.rpc.direct import DirectDialError, TcpChannel
from swarm.rpc.links import Links
from swarm.rpc.punch import punched
from swarm.rpc.secure import client_context
from swarm.rpc.transport import Channel, P2PChannel, Transport, choose_transport, stream_rpc, unary

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


def _direct_key(hop: Hop) -> str:
    """What a failed direct dial is remembered by: the address dialled, or the peer punched through to."""
    return hop.direct or f"punch:{hop.peer_id}"


def unavailable(peer_id: str, what: str, e: BaseException | None = None) -> SwarmError:
    detail = f": {type(e).__name__}: {e}" if e is not None else ""
    error = PeerUnavailableError(f"peer {peer_id} {what}{detail}")
    error.peer_id = peer_id
    error.cause = e
    return error


def _parse(message: wire.Message | None, cls: type[R], peer_id: str) -> tuple[R, Tensors]:
    if message is None:
        raise unavailable(peer_id, "closed the call without a reply")
    try:
        return parse_reply(message[0], cls, peer_id), message[1]
    except SwarmError:  # the error the server named (some are ValueErrors too: bad input)
        raise
    except ValueError as e:  # pydantic: a reply that is neither an error nor what this call returns
        raise unavailable(peer_id, "sent a malformed reply", e) from None


@functools.lru_cache(maxsize=1024)  # asked for every hop of every step: a hop's addresses never change
def _on_loopback(hop: Hop) -> bool:
    """Every address ``hop`` announces is a loopback one (``127.0.0.0/8`` or ``::1``)."""
    addresses = [hop.direct.rsplit(":", 1)[0]] if hop.direct else []
    addresses += [m.split("/")[2] for m in hop.maddrs if m.startswith(("/ip4/", "/ip6/"))]
    return bool(addresses) and all(a.startswith("127.") or a in ("::1", "[::1]") for a in addresses)


class Remote:
    """One party's transport state: its P2P replica, the peers it has dialled, its direct-TCP policy, its kept-open
    compute connections and the traffic it counted."""

    def __init__(
        self,
        p2p: P2P,
        creds: Credentials,
        direct: DirectPolicy = "auto",
        *,
        pool_size: int = 4,
        max_reply_bytes: int = 1 << 28,
        dial_timeout: float = 5.0,
        fallback_s: float = 60.0,
        pool_idle: float = 15.0,
        codec: Codec | None = None,
    ) -> None:
        self.p2p = p2p
        self.creds = creds
        self.direct: DirectPolicy = direct
        self.tls = client_context()
        self.dial_timeout = dial_timeout  # TCP connect + TLS + the server's signed hello
        self.fallback_s = fallback_s  # a direct address that failed to dial is left alone this long ("auto")
        self._unreachable: dict[str, float] = {}  # direct address -> when to try it again
        self.pool_idle = pool_idle  # a kept-open connection unused this long is closed rather than reused
        self.pool_size = pool_size  # idle compute connections kept per server (micro-batches in flight)
        self.max_reply_bytes = max_reply_bytes  # a reply larger than this is refused: replies are hostile too
        self.traffic: Counter[str] = Counter()  # sent_bytes / received_bytes over every message, all transports
        # and, per compute call or inference step: codec.{name} (the codec of its activations, both ways) and
        # activation_bytes (their float bytes before compression, as sent)
        self.codec = codec  # forced activation codec (None: chosen per call from the link estimate)
        self.links = Links()
        self._dialled: set[str] = set()
        self._idle: dict[str, list[TcpChannel]] = {}  # "peer@address" -> kept-open compute connections

    def transport(self, hop: Hop, rpc: str, frames: list[wire.Frame] | None = None) -> Transport:
        frames = frames or []
        reachable = self._unreachable.get(_direct_key(hop), 0.0) <= time.monotonic()
        return choose_transport(hop, rpc, wire.encoded_size(frames), len(frames), self.direct, reachable)

    def meta(self, request: Request) -> dict[str, object]:
        """A request's metadata as sent: with this caller's membership token in a private swarm."""
        meta = request.model_dump(mode="json")
        if self.creds.member is not None:
            meta["member"] = self.creds.member
        return meta

    async def _dial(self, hop: Hop, rpc: str, limit: int) -> TcpChannel | None:
        """A direct connection to ``hop``, or None where ``auto`` should take libp2p instead (its address did not
        answer as that peer, or a peer behind NAT could not be punched through to: remembered for ``fallback_s``)."""
        try:
            if hop.direct is None:  # behind a NAT: counted per peer (``punched:ID``, ``punch_failed:ID``)
                channel = await punched(
                    hop.peer_id,
                    hop.punch_via,
                    rpc,
                    limit,
                    functools.partial(self._signal, hop),
                    self.creds,
                    self.tls,
                    self.dial_timeout,
                )
                self.traffic[f"punched:{hop.peer_id}"] += 1
                if channel.reverse:  # the peer's SYNs reached this host's listening port (a reachable caller)
                    self.traffic[f"punched_reverse:{hop.peer_id}"] += 1
                return channel
            return await TcpChannel.open(hop.direct, hop.peer_id, rpc, limit, self.creds, self.tls, self.dial_timeout)
        except DirectDialError as e:
            if hop.direct is None:
                self.traffic[f"punch_failed:{hop.peer_id}"] += 1
            if self.direct == "always":
                raise unavailable(hop.peer_id, "cannot be dialled directly", e) from None
            log.info("direct dial failed, using libp2p: %s", e, extra={"peer": hop.peer_id})
            now = time.monotonic()
            if len(self._unreachable) >= 1024:  # addresses come from records anyone can write: keep this bounded
                self._unreachable = {a: t for a, t in self._unreachable.items() if t > now}
                if len(self._unreachable) >= 1024:
                    self._unreachable.clear()  # forgetting costs one more failed dial each, nothing else
            self._unreachable[_direct_key(hop)] = now + self.fallback_s
            return None

    async def _signal(self, hop: Hop, mine: ObserveReply) -> str:
        """Hole punching's signal: this host's endpoint (and its observer's signed word for it) to ``hop`` (over
        libp2p, through its relay), its own back."""
        request = PunchRequest(address=mine.address, observed=mine.signed)
        reply, _ = await self.call(hop, RPC_PUNCH, request, {}, self.dial_timeout, PunchReply)
        return reply.address

    async def _peer(self, hop: Hop) -> PeerID:
        peer = PeerID.from_base58(hop.peer_id)
        # a peer behind NAT is reached through relays that come and go: its daemon is given the record's addresses
        # every time (at once when connected), never left to redial a dead relay it remembers
        relayed = any(CIRCUIT in m for m in hop.maddrs)
        if (relayed or hop.peer_id not in self._dialled) and hop.maddrs:
            try:
                await self.p2p._client.connect(peer, [dial_addr(m) for m in hop.maddrs])
            except Exception as e:
                raise unavailable(hop.peer_id, f"cannot be reached at {', '.join(hop.maddrs)}", e) from None
            self._dialled.add(hop.peer_id)
        return peer

    async def open_channel(self, hop: Hop, rpc: str, max_bytes: int | None = None) -> Channel:
        """A stream to ``hop`` for ``rpc``: direct TCP where the policy allows, else libp2p."""
        limit = max_bytes or self.max_reply_bytes
        if self.transport(hop, rpc) == Transport.DIRECT:
            channel = await self._dial(hop, rpc, limit)
            if channel is not None:
                return channel
        dialled = hop.peer_id in self._dialled
        try:
            return await P2PChannel.open(self.p2p, await self._peer(hop), stream_rpc(rpc), limit)
        except SwarmError:
            raise
        except Exception:
            if not dialled or not hop.maddrs:
                raise
        # the connection it had is gone (its relay died, a NAT forgot it) and the daemon redials only the
        # addresses it kept, for a while: dial again where the peer's record says it is now
        self._dialled.discard(hop.peer_id)
        return await P2PChannel.open(self.p2p, await self._peer(hop), stream_rpc(rpc), limit)

    async def _exchange(
        self, hop: Hop, rpc: str, frames: list[wire.Frame], max_bytes: int | None = None
    ) -> wire.Message | None:
        """One request, one reply, over the transport chosen for it (replies bounded by ``max_bytes``, default the
        transport's bound)."""
        return (await self._exchange_counted(hop, rpc, frames, max_bytes))[0]

    async def _exchange_counted(
        self, hop: Hop, rpc: str, frames: list[wire.Frame], max_bytes: int | None = None
    ) -> tuple[wire.Message | None, int]:
        """``_exchange``, and the bytes its reply took."""
        transport = self.transport(hop, rpc, frames)
        limit = min(max_bytes or self.max_reply_bytes, self.max_reply_bytes)
        if transport == Transport.POOLED:
            pooled = await self._pooled_channel(hop, limit)
            if pooled is not None:
                return await self._pooled(hop, pooled, frames)
            transport = self.transport(hop, rpc, frames)  # the address failed: libp2p
        if transport == Transport.UNARY:
            decoder = wire.Decoder(limit)
            message = decoder.feed(await unary(self.p2p, await self._peer(hop), rpc, frames[0]))
            self.traffic["received_bytes"] += decoder.total_bytes
            if message is None:
                raise unavailable(hop.peer_id, "sent a reply that ends before all its tensors")
            return message, decoder.total_bytes
        channel = await self.open_channel(hop, rpc, limit)
        try:
            await channel.send(frames)
            return await channel.receive(), channel.decoder.total_bytes
        finally:
            self.traffic["received_bytes"] += channel.decoder.total_bytes
            channel.close()

    async def _pooled_channel(self, hop: Hop, limit: int) -> TcpChannel | None:
        """A kept-open connection that is still fresh (servers close compute connections idle for
        ``Timing.stream_idle``; this side lets them go sooner, after ``pool_idle``), or a new one."""
        idle = self._idle.get(f"{hop.peer_id}@{hop.direct}", [])
        channel: TcpChannel | None = None
        while idle and channel is None:
            candidate = idle.pop()
            if candidate.reader.at_eof() or time.monotonic() - candidate.last_used > self.pool_idle:
                candidate.close()
            else:
                channel = candidate
        if channel is None:
            channel = await self._dial(hop, RPC_COMPUTE_LOOP, limit)
        if channel is not None:
            channel.decoder.max_bytes = limit  # this call's reply bound, whatever the connection carried before
        return channel

    async def _pooled(self, hop: Hop, channel: TcpChannel, frames: list[wire.Frame]) -> tuple[wire.Message | None, int]:
        """One compute call over a kept-open connection to ``hop``; the connection goes back to the pool only after
        a complete reply, so a broken or abandoned one is never reused."""
        idle = self._idle.setdefault(f"{hop.peer_id}@{hop.direct}", [])
        try:
            await channel.send(frames)
            message = await channel.receive()
        except BaseException:
            channel.close()
            raise
        finally:
            received = channel.decoder.total_bytes
            self.traffic["received_bytes"] += received
            channel.decoder.total_bytes = 0
        if message is not None and len(idle) < self.pool_size:
            channel.last_used = time.monotonic()
            idle.append(channel)
        else:
            channel.close()
        return message, received

    def codec_for(self, hop: Hop, tensors: Tensors) -> Codec:
        """The codec for the activations of a call to ``hop`` carrying ``tensors``, and of its reply (as large: a
        hidden state for a hidden state, a gradient for a gradient): forced, or chosen from the link estimate. A
        server on this very machine (a loopback address) gets exact tensors: both ends share the CPU that would
        compress, and a link estimate there measures that CPU, not a network."""
        if self.codec is None and _on_loopback(hop):
            return Codec.none
        nbytes = sum(t.nbytes for name, t in tensors.items() if name in ACTIVATIONS and t.is_floating_point())
        return choose_codec(nbytes, self.links.mbps(hop.peer_id, hop.network_mbps), forced=self.codec)

    def _count(self, codec: Codec, tensors: Tensors) -> None:
        self.traffic[f"codec.{codec}"] += 1
        self.traffic["activation_bytes"] += sum(t.nbytes for n, t in tensors.items() if n in ACTIVATIONS)

    async def call(
        self,
        hop: Hop,
        rpc: str,
        request: Request,
        tensors: Tensors,
        timeout: float,
        reply: type[R],
        max_bytes: int | None = None,
        codec: Codec | None = None,
    ) -> tuple[R, Tensors]:
        """Send ``request`` (with ``tensors``, activations in ``codec``) and return the typed reply and its
        tensors."""
        frames = wire.encode(self.meta(request), tensors, codec)
        sent = wire.encoded_size(frames)
        self.traffic["sent_bytes"] += sent
        t0 = time.perf_counter()
        try:
            message, received = await asyncio.wait_for(self._exchange_counted(hop, rpc, frames, max_bytes), timeout)
        except SwarmError as e:
            e.peer_id = hop.peer_id
            raise
        except Exception as e:
            self._dialled.discard(hop.peer_id)
            raise unavailable(hop.peer_id, "failed", e) from None
        self.links.observe(hop.peer_id, sent + received, time.perf_counter() - t0, hop.network_mbps)
        return _parse(message, reply, hop.peer_id)

    async def exchange_raw(
        self, hop: Hop, rpc: str, meta: dict[str, object], tensors: Tensors, timeout: float
    ) -> wire.Message | None:
        """Hand-written metadata, as a buggy or hostile peer might send it, and the raw reply (tests and tools: every
        call of the library itself goes through a typed request)."""
        if self.creds.member is not None:
            meta = {"member": self.creds.member, **meta}
        return await asyncio.wait_for(self._exchange(hop, rpc, wire.encode(meta, tensors)), timeout)

    async def compute(
        self,
        hop: Hop,
        request: ForwardRequest | BackwardRequest,
        tensors: Tensors,
        timeout: float,
        max_bytes: int | None = None,
    ) -> Tensors:
        """``max_bytes``: the largest reply this request can honestly get (the caller knows what it asked for).
        Activations travel both ways in ``request.codec`` if set, else in the codec ``codec_for`` picks."""
        codec = request.codec or self.codec_for(hop, tensors)
        request = request.model_copy(update={"codec": None if codec == Codec.none else codec})
        self._count(codec, tensors)
        return (await self.call(hop, RPC_FORWARD, request, tensors, timeout, Reply, max_bytes, codec))[1]

    async def state(
        self, hop: Hop, timeout: float, max_bytes: int, last_round: bool = False
    ) -> tuple[StateReply, Tensors]:
        """A trainable stage's weights and Adam moments, from the server of ``hop`` (which must hold exactly its
        blocks), over a stream of its own: the reply is as large as the stage (at most ``max_bytes``, what the caller
        knows such a stage takes). ``last_round``: the state it ended its last averaging round with."""
        request = StateRequest(start=hop.start, end=hop.end, round=last_round)
        return await self.call(hop, RPC_FORWARD_STREAM, request, {}, timeout, StateReply, max_bytes)

    async def notify(self, hops: list[Hop], request: StepNotice | ReleaseRequest, timeout: float) -> list[SwarmError]:
        """The same small notice to many servers at once; returns the failures (each tagged with its peer)."""
        results = await asyncio.gather(
            *(self.call(h, RPC_FORWARD, request, {}, timeout, Reply) for h in hops), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, SwarmError)]
        unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, SwarmError)]
        if unexpected:
            raise unexpected[0]
        return failures

    async def send_payload(self, hop: Hop, nbytes: int, timeout: float) -> float:
        """Seconds to send ``nbytes`` to a peer and hear it arrived, over the path real traffic would take."""
        t0 = time.perf_counter()
        got, _ = await self.call(
            hop, RPC_BANDWIDTH, BandwidthProbe(), {"payload": torch.zeros(nbytes // 4)}, timeout, BandwidthReply
        )
        if got.received < nbytes // 4 * 4:
            raise unavailable(hop.peer_id, f"confirmed {got.received} of {nbytes} probe bytes")
        return time.perf_counter() - t0

    async def info(self, hop: Hop, timeout: float) -> InfoReply:
        return (await self.call(hop, RPC_INFO, InfoRequest(), {}, timeout, InfoReply))[0]

    def close(self) -> None:
        for channels in self._idle.values():
            for channel in channels:
                channel.close()
        self._idle.clear()
