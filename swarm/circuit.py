"""libp2p's circuit relay v2 reservation message, as its relays speak it (``/libp2p/circuit/relay/0.2.0/hop``).

A peer behind NAT holds a slot on a relay by sending ``RESERVE`` on a hop stream over its own connection to the
relay; the relay answers ``STATUS`` with the reservation's expiry, and while the connection lives, strangers who
dial ``RELAY/p2p-circuit/p2p/PEER`` are put through to it. p2pd's own relay finder does this too, but only after
a 3-minute boot delay with fewer than 4 relay candidates (docs/links.md), so the node sends it itself through its
daemon's stream API. The messages are libp2p's protobufs (``circuit.proto`` of the spec), built here from a
descriptor with the protobuf runtime hivemind already uses: no generated code, no hand-written parser. Everything
read is bounded: one varint-prefixed message of at most ``MAX_MESSAGE`` bytes, within the caller's timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Protocol

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

if TYPE_CHECKING:
    from hivemind.p2p import P2P, PeerID

HOP = "/libp2p/circuit/relay/0.2.0/hop"  # a peer to a relay: reserve a slot, or connect to a peer holding one
STOP = "/libp2p/circuit/relay/0.2.0/stop"  # a relay to the peer holding a slot: someone connects to you
MAX_MESSAGE = 4096  # a reservation answer holds a few addresses and a signed voucher: well under this
RESERVE, CONNECT, STATUS = 0, 1, 2  # HopMessage types
STOP_CONNECT, STOP_STATUS = 0, 1  # StopMessage types
OK = 100
RESERVATION_REFUSED, RESOURCE_LIMIT_EXCEEDED, PERMISSION_DENIED, CONNECTION_FAILED, NO_RESERVATION = range(200, 205)
MALFORMED_MESSAGE, UNEXPECTED_MESSAGE = 400, 401
STATUS_NAMES = {
    100: "OK",
    200: "RESERVATION_REFUSED",
    201: "RESOURCE_LIMIT_EXCEEDED",
    202: "PERMISSION_DENIED",
    203: "CONNECTION_FAILED",
    204: "NO_RESERVATION",
    400: "MALFORMED_MESSAGE",
    401: "UNEXPECTED_MESSAGE",
}


class CircuitError(Exception):
    """A relay refused the reservation, or answered something that is not one."""


@dataclass(frozen=True)
class Reservation:
    """A relay's answer to ``RESERVE``: until when (unix seconds), and its limits per relayed connection."""

    expire: int
    limit_s: int  # 0: none given
    limit_bytes: int  # 0: none given


class _PeerField(Protocol):
    id: bytes


class _ReservationField(Protocol):
    expire: int


class _LimitField(Protocol):
    duration: int
    data: int


class CircuitMessage(Protocol):
    """A ``HopMessage`` or ``StopMessage`` (classes protobuf builds at run time from ``_messages``' descriptors, so
    nothing types them there): the fields this code reads. A ``StopMessage`` has no ``reservation``."""

    type: int
    status: int
    peer: _PeerField
    reservation: _ReservationField
    limit: _LimitField

    def HasField(self, name: str) -> bool: ...
    def SerializeToString(self) -> bytes: ...
    def ParseFromString(self, data: bytes) -> int: ...


class StreamInfo(Protocol):
    """What a stream handler reads of hivemind's ``StreamInfo``: who opened the stream, and over which address."""

    peer_id: PeerID
    addr: object


def _field(name: str, number: int, kind: int, label: int = 1, type_name: str = "") -> object:
    return descriptor_pb2.FieldDescriptorProto(
        name=name, number=number, type=kind, label=label, **({"type_name": type_name} if type_name else {})
    )


@cache
def _messages() -> dict[str, Callable[..., CircuitMessage]]:
    """The circuit v2 message classes (the spec's ``circuit.proto``, proto2). Enums are read as plain numbers, so an
    unknown one parses and is refused by the code that reads it, not by the parser."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="swarm_circuit_v2.proto", package="swarm.circuit.pb", syntax="proto2"
    )
    file.message_type.add(
        name="Peer", field=[_field("id", 1, f.TYPE_BYTES), _field("addrs", 2, f.TYPE_BYTES, f.LABEL_REPEATED)]
    )
    file.message_type.add(
        name="Reservation",
        field=[
            _field("expire", 1, f.TYPE_UINT64),
            _field("addrs", 2, f.TYPE_BYTES, f.LABEL_REPEATED),
            _field("voucher", 3, f.TYPE_BYTES),
        ],
    )
    file.message_type.add(name="Limit", field=[_field("duration", 1, f.TYPE_UINT32), _field("data", 2, f.TYPE_UINT64)])
    peer, limit = ".swarm.circuit.pb.Peer", ".swarm.circuit.pb.Limit"
    file.message_type.add(
        name="HopMessage",
        field=[
            _field("type", 1, f.TYPE_UINT32),
            _field("peer", 2, f.TYPE_MESSAGE, type_name=peer),
            _field("reservation", 3, f.TYPE_MESSAGE, type_name=".swarm.circuit.pb.Reservation"),
            _field("limit", 4, f.TYPE_MESSAGE, type_name=limit),
            _field("status", 5, f.TYPE_UINT32),
        ],
    )
    file.message_type.add(
        name="StopMessage",
        field=[
            _field("type", 1, f.TYPE_UINT32),
            _field("peer", 2, f.TYPE_MESSAGE, type_name=peer),
            _field("limit", 3, f.TYPE_MESSAGE, type_name=limit),
            _field("status", 4, f.TYPE_UINT32),
        ],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"swarm.circuit.pb.{name}"))
        for name in ("HopMessage", "StopMessage")
    }


def hop_message(**fields: object) -> CircuitMessage:
    return _messages()["HopMessage"](**fields)


def stop_message(**fields: object) -> CircuitMessage:
    return _messages()["StopMessage"](**fields)


def parse(kind: str, data: bytes) -> CircuitMessage:
    """``data`` as a ``HopMessage`` or ``StopMessage``, or ``CircuitError``."""
    message = _messages()[kind]()
    try:
        message.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError and friends: the bytes are not such a message
        raise CircuitError(f"not a circuit v2 {kind}: {e}") from e
    return message


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(message: CircuitMessage) -> bytes:
    """A message as libp2p writes it on a stream: its length as an unsigned varint, then its bytes."""
    data = message.SerializeToString()
    return varint(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One varint-prefixed message, refused beyond ``MAX_MESSAGE`` bytes before it is read."""
    size, shift = 0, 0
    for _ in range(3):  # MAX_MESSAGE fits two varint bytes; a third that still continues is too long
        byte = (await reader.readexactly(1))[0]
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    else:
        raise CircuitError("a relay's message length does not end")
    if size > MAX_MESSAGE:
        raise CircuitError(f"a relay's message of {size} bytes (at most {MAX_MESSAGE})")
    return await reader.readexactly(size)


def reserve_request() -> bytes:
    return frame(hop_message(type=RESERVE))


def parse_reservation(data: bytes) -> Reservation:
    """A relay's answer to ``RESERVE``: the reservation, or ``CircuitError`` naming the relay's refusal."""
    message = parse("HopMessage", data)
    if message.type != STATUS:
        raise CircuitError(f"a relay answered RESERVE with message type {message.type}, not STATUS")
    if message.status != OK:
        raise CircuitError(f"the relay refused: {STATUS_NAMES.get(message.status, message.status)}")
    if not message.HasField("reservation") or not message.reservation.expire:
        raise CircuitError("the relay said OK but gave no reservation")
    return Reservation(
        expire=int(message.reservation.expire),
        limit_s=int(message.limit.duration) if message.HasField("limit") else 0,
        limit_bytes=int(message.limit.data) if message.HasField("limit") else 0,
    )


Handler = Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def take_hop(p2p: P2P, handler: Handler | None = None) -> None:
    """Take the relay protocol off a p2p daemon (hivemind's ``P2P``): ``handler`` answers it from now on, or
    nobody does (a handler put in place of the daemon's built-in relay, then removed). The daemon's own relay
    serves anyone with go-libp2p's default limits whatever its flags say (``peers.relay_service``)."""
    if handler is not None:
        await p2p.add_binary_stream_handler(HOP, handler)
        return
    await p2p.add_binary_stream_handler(HOP, _refuse)
    await p2p.remove_binary_stream_handler(HOP)


async def _refuse(_info: StreamInfo, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()
