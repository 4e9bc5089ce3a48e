"""Relaying for peers behind NAT (``--relay``), within the bounds the volunteer gave, done here rather than by p2pd.

The p2pd in hivemind's wheel relays for anyone whenever relaying is on at all (``-relay``, which a peer needs to
dial or accept relayed connections): at start it installs a second relay service with go-libp2p's defaults over
the one its ``-relayService``/``-relay*`` flags configure, so those flags change nothing, and every peer relays up to
128 KiB and 2 minutes a connection for 128 peers (measured: the reservation it grants says so, and a connection
is reset after 128 KiB whatever ``-relayDataLimit`` says; docs/links.md). 128 KiB is a hole-punching budget, not a
data plane. So every peer takes the relay protocol off its daemon (``take_hop``): a peer that offers no relaying
answers nothing, and a ``--relay`` peer answers it here, with the circuit v2 protocol (``swarm.circuit``) and its
own bounds: slots (``max_reservations``, one per peer, only for peers of the swarm and at most ``max_per_range``
from one address range: ``peers.relay_admission``), connections per peer (``max_circuits``, counted at both
ends), bytes each way per connection (``data_bytes``, then it is closed) and time per connection (``time_s``).
Every byte it relays goes through this process, where ``RelayStats`` counts it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID

from peers.relay_admission import BUSY, Admission, address_range
from swarm.circuit import (
    CONNECT,
    CONNECTION_FAILED,
    MALFORMED_MESSAGE,
    NO_RESERVATION,
    OK,
    PERMISSION_DENIED,
    RESERVE,
    RESOURCE_LIMIT_EXCEEDED,
    STATUS,
    STATUS_NAMES,
    STOP,
    STOP_CONNECT,
    STOP_STATUS,
    UNEXPECTED_MESSAGE,
    CircuitError,
    CircuitMessage,
    StreamInfo,
    frame,
    hop_message,
    parse,
    read_frame,
    stop_message,
)
from swarm.relay import CIRCUIT, RelayPolicy

log = logging.getLogger(__name__)
RESERVATION_TTL_S = 120  # a slot lives this long unless renewed (``peers.relay_slots`` renews it every 30 s)
HANDSHAKE_S = 10.0  # the first message of a hop stream, and the target's answer to a connection
MAX_PEER_ID = 64  # bytes of a peer id (a multihash of an RSA or Ed25519 key is well under)


@dataclass
class RelayStats:
    """What the relay has done: slots held now, connections open now and in all, bytes relayed (both ways), and
    refusals by reason."""

    reservations: int = 0
    circuits_open: int = 0
    circuits_total: int = 0
    bytes_relayed: int = 0
    refused: Counter[str] = field(default_factory=Counter)


class RelayService:
    """The hop side of circuit relay v2 for one ``--relay`` peer. ``clock`` is wall time (a reservation's expiry
    is a unix time on the wire)."""

    def __init__(
        self, p2p: P2P, policy: RelayPolicy, admission: Admission, clock: Callable[[], float] = time.time
    ) -> None:
        self.p2p, self.policy, self.admission, self.clock = p2p, policy, admission, clock
        self.slots: dict[PeerID, float] = {}  # who holds a slot, until when
        self.ranges: dict[PeerID, str] = {}  # the address range each holder reserved from
        self.circuits: Counter[PeerID] = Counter()  # open connections each peer is an end of
        self.stats = RelayStats()

    async def handle(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One hop stream: a peer reserving a slot, or connecting to a peer that holds one."""
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                message = parse("HopMessage", await read_frame(reader))
            if message.type == RESERVE:
                await self._reserve(info, writer)
            elif message.type == CONNECT:
                await self._connect(info, message, reader, writer)
            else:
                await self._status(writer, UNEXPECTED_MESSAGE)
        except (CircuitError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("bad hop stream from %s: %s", info.peer_id, e)
            with contextlib.suppress(Exception):
                await self._status(writer, MALFORMED_MESSAGE)
        except (ConnectionError, OSError) as e:  # the caller or the target went away
            log.debug("hop stream from %s ended: %s", info.peer_id, e)
        finally:
            writer.close()

    async def _status(self, writer: asyncio.StreamWriter, status: int, why: str = "", **fields: object) -> None:
        if status != OK:
            reason = why or STATUS_NAMES.get(status, str(status))
            self.stats.refused[reason] += 1
            log.info("relay refused: %s", reason)
        writer.write(frame(hop_message(type=STATUS, status=status, **fields)))
        await writer.drain()

    def _expire(self) -> None:
        now = self.clock()
        for peer in [p for p, until in self.slots.items() if until <= now]:
            del self.slots[peer]
            self.ranges.pop(peer, None)
        self.stats.reservations = len(self.slots)

    def _full(self, peer: PeerID, where: str) -> str:
        """Why ``peer`` reserving from range ``where`` would exceed a bound ("" if it would not)."""
        if peer in self.slots and self.ranges.get(peer) == where:
            return ""  # a renewal from where it reserved
        if len(self.slots) - (peer in self.slots) >= self.policy.max_reservations:
            return "slots_full"
        others = sum(1 for p, r in self.ranges.items() if r == where and p != peer)
        return "range_full" if others >= self.policy.max_per_range else ""

    async def _reserve(self, info: StreamInfo, writer: asyncio.StreamWriter) -> None:
        self._expire()
        peer, where = info.peer_id, address_range(str(info.addr))
        if CIRCUIT in str(info.addr):  # a slot is reached over the holder's own connection, not another relay's
            return await self._status(writer, PERMISSION_DENIED)
        if full := self._full(peer, where):
            return await self._status(writer, RESOURCE_LIMIT_EXCEEDED, full)
        refusal = await self.admission.refusal(peer.to_base58(), holder=peer in self.slots)
        if refusal is not None:
            status = RESOURCE_LIMIT_EXCEEDED if refusal == BUSY else PERMISSION_DENIED
            return await self._status(writer, status, refusal)
        self._expire()
        if full := self._full(peer, where):  # others may have reserved while the heartbeat was read
            return await self._status(writer, RESOURCE_LIMIT_EXCEEDED, full)
        expire = int(self.clock()) + RESERVATION_TTL_S
        if peer not in self.slots:
            log.info("relay slot granted", extra={"peer": str(peer), "range": where})
        self.slots[peer], self.ranges[peer] = float(expire), where
        self.stats.reservations = len(self.slots)
        limit = {"duration": self.policy.time_s, "data": self.policy.data_bytes}
        await self._status(writer, OK, reservation={"expire": expire}, limit=limit)

    async def _connect(
        self, info: StreamInfo, message: CircuitMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        source = info.peer_id
        raw = bytes(message.peer.id) if message.HasField("peer") else b""
        if not 0 < len(raw) <= MAX_PEER_ID:
            return await self._status(writer, MALFORMED_MESSAGE)
        target = PeerID(raw)
        self._expire()
        if CIRCUIT in str(info.addr):  # no chains of relays
            return await self._status(writer, PERMISSION_DENIED)
        if target not in self.slots:
            return await self._status(writer, NO_RESERVATION)
        ends = (source, target)
        total_cap = self.policy.max_reservations * self.policy.max_circuits
        if any(self.circuits[p] >= self.policy.max_circuits for p in ends) or self.stats.circuits_open >= total_cap:
            return await self._status(writer, RESOURCE_LIMIT_EXCEEDED)
        for p in ends:
            self.circuits[p] += 1
        self.stats.circuits_open += 1
        try:
            stop = await self._stop(source, target)
            if stop is None:
                return await self._status(writer, CONNECTION_FAILED)
            await self._status(writer, OK)
            self.stats.circuits_total += 1
            log.info("relaying %s -> %s", source, target)
            await self._splice((reader, writer), stop)
        finally:
            for p in ends:
                self.circuits[p] -= 1
                if self.circuits[p] <= 0:
                    del self.circuits[p]
            self.stats.circuits_open -= 1

    async def _stop(self, source: PeerID, target: PeerID) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A stream to ``target`` that has accepted a connection from ``source``, or None."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                _, reader, writer = await self.p2p._client.stream_open(target, [STOP])
                writer.write(frame(stop_message(type=STOP_CONNECT, peer={"id": source.to_bytes()})))
                await writer.drain()
                answer = parse("StopMessage", await read_frame(reader))
            if answer.type == STOP_STATUS and answer.status == OK:
                return reader, writer
            log.debug("%s refused a relayed connection: %s", target, STATUS_NAMES.get(answer.status, answer.status))
        except Exception as e:  # the target is gone or answered nonsense: the caller is told the connection failed
            log.debug("no relayed connection to %s: %s", target, e)
        if writer is not None:
            writer.close()
        return None

    async def _splice(
        self, a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    ) -> None:
        """Copy both ways until either side ends, a direction passes ``data_bytes`` or ``time_s`` passes."""
        try:
            async with asyncio.timeout(self.policy.time_s):
                copies = [asyncio.create_task(self._copy(a[0], b[1])), asyncio.create_task(self._copy(b[0], a[1]))]
                try:
                    await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in copies:
                        task.cancel()
                    await asyncio.gather(*copies, return_exceptions=True)
        except TimeoutError:
            self.stats.refused["time_limit"] += 1
        finally:
            b[1].close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = 0
        while True:
            chunk = await reader.read(self.policy.buffer_bytes)
            if not chunk:
                return
            if sent + len(chunk) > self.policy.data_bytes:
                self.stats.refused["data_limit"] += 1
                return
            writer.write(chunk)
            await writer.drain()  # holds at most the stream's buffer for a slow reader
            sent += len(chunk)
            self.stats.bytes_relayed += len(chunk)
