"""Circuit relay v2 as the swarm speaks it (``swarm.circuit``): messages in libp2p's wire format, bounded reads, and
the relay's side (``peers.relay_service``) holding its bounds against callers that push past them. The streams here
are in-memory pairs; tests/integration/test_relay_flags.py runs the same code between real p2p daemons."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID

from peers.relay_admission import GRACE_S, LOOKUPS, RECHECK_S, REFUSED_S, Admission, address_range
from peers.relay_service import RESERVATION_TTL_S, RelayService
from swarm.circuit import (
    CONNECT,
    MAX_MESSAGE,
    OK,
    RESERVE,
    STATUS,
    STOP_STATUS,
    CircuitError,
    frame,
    hop_message,
    parse,
    parse_reservation,
    read_frame,
    stop_message,
    varint,
)
from swarm.relay import RelayPolicy

A = PeerID.from_base58("QmQJ8QnNsJdRrw9YQ8NikgevHeXB1yCpvg7oKenzAHp8ic")
B = PeerID.from_base58("QmbTghmKayfByLZqY4eUqwERKtLM1tR5fJPj96J8GVTdhy")
C = PeerID.from_base58("12D3KooWKUXEpbqppZ8cG3qCCkJGPMmu8hb1z8ZiU2sbTbFvRNHX")


async def _anyone(_peer: str) -> bool:
    return True


ANYONE = Admission(_anyone)  # these tests are about other bounds: every caller is a member


def test_a_reserve_request_is_what_libp2p_sends():
    # length 2, then field 1 (varint) = 0: RESERVE, as go-libp2p's client writes it
    assert frame(hop_message(type=RESERVE)) == b"\x02\x08\x00"
    assert varint(300) == b"\xac\x02"


def test_a_reservation_answer_is_read_and_a_refusal_named():
    answer = frame(hop_message(type=STATUS, status=OK, reservation={"expire": 99}, limit={"duration": 5, "data": 7}))
    got = parse_reservation(answer[1:])
    assert (got.expire, got.limit_s, got.limit_bytes) == (99, 5, 7)
    with pytest.raises(CircuitError, match="RESERVATION_REFUSED"):
        parse_reservation(hop_message(type=STATUS, status=200).SerializeToString())
    with pytest.raises(CircuitError, match="not STATUS"):
        parse_reservation(hop_message(type=CONNECT).SerializeToString())
    with pytest.raises(CircuitError, match="no reservation"):
        parse_reservation(hop_message(type=STATUS, status=OK).SerializeToString())
    with pytest.raises(CircuitError, match="not a circuit v2"):
        parse("HopMessage", b"\xff\xff\xff")


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_reads_are_bounded_before_anything_is_read():
    async def read(data: bytes) -> bytes:
        return await read_frame(_reader(data))

    assert asyncio.run(read(b"\x02ab")) == b"ab"
    with pytest.raises(CircuitError, match="at most"):
        asyncio.run(read(varint(MAX_MESSAGE + 1) + b"x"))
    with pytest.raises(CircuitError, match="does not end"):
        asyncio.run(read(b"\xff\xff\xff\xff"))
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(read(b"\x05ab"))


class Sink:
    """A stream writer that keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Info:
    def __init__(self, peer: PeerID, addr: str = "/ip4/10.0.0.2/tcp/4001") -> None:
        self.peer_id, self.addr = peer, addr


class FakeDaemon:
    """``stream_open`` to a target that accepts (STOP status OK) and echoes what follows, or refuses."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.opened: list[PeerID] = []
        self._client = self

    async def stream_open(self, peer: PeerID, protocols: list[str]):
        self.opened.append(peer)
        answer = frame(stop_message(type=STOP_STATUS, status=OK if self.accept else 203))
        return None, _reader(answer + b"relayed bytes"), Sink()


def _answer(sink: Sink):
    return parse("HopMessage", bytes(sink.data[1 : 1 + sink.data[0]]))


def _run(service: RelayService, peer: PeerID, message, addr: str = "/ip4/10.0.0.2/tcp/4001", tail: bytes = b""):
    out = Sink()

    async def go() -> None:
        await service.handle(Info(peer, addr), _reader(frame(message) + tail), out)

    asyncio.run(go())
    return _answer(out), out


def test_the_relay_grants_slots_within_its_bound_and_renews_them():
    clock = [1000.0]
    service = RelayService(FakeDaemon(), RelayPolicy(offer=True, max_reservations=2), ANYONE, clock=lambda: clock[0])
    for peer in (A, B, A):  # A renews: still two peers
        answer, _ = _run(service, peer, hop_message(type=RESERVE))
        assert answer.status == OK and answer.reservation.expire == 1000 + RESERVATION_TTL_S
    answer, _ = _run(service, C, hop_message(type=RESERVE))
    assert answer.status == 201  # RESOURCE_LIMIT_EXCEEDED
    clock[0] += RESERVATION_TTL_S + 1  # both lapse: room again
    answer, _ = _run(service, C, hop_message(type=RESERVE))
    assert answer.status == OK and service.stats.reservations == 1


def test_no_slot_over_a_relayed_connection_and_no_connection_without_a_slot():
    service = RelayService(FakeDaemon(), RelayPolicy(offer=True), ANYONE)
    answer, _ = _run(service, A, hop_message(type=RESERVE), addr="/ip4/1.2.3.4/tcp/1/p2p/X/p2p-circuit")
    assert answer.status == 202  # PERMISSION_DENIED
    answer, _ = _run(service, B, hop_message(type=CONNECT, peer={"id": A.to_bytes()}))
    assert answer.status == 204  # NO_RESERVATION
    answer, _ = _run(service, B, hop_message(type=CONNECT))
    assert answer.status == 400  # MALFORMED_MESSAGE: no peer named
    answer, _ = _run(service, B, hop_message(type=7))
    assert answer.status == 401


def test_a_connection_is_put_through_and_its_bytes_counted_within_the_data_bound():
    daemon = FakeDaemon()
    service = RelayService(daemon, RelayPolicy(offer=True, data_bytes=10, buffer_bytes=4), ANYONE)
    _run(service, A, hop_message(type=RESERVE))
    answer, out = _run(service, B, hop_message(type=CONNECT, peer={"id": A.to_bytes()}), tail=b"hello")
    assert answer.status == OK and daemon.opened == [A]
    relayed = bytes(out.data[1 + out.data[0] :])
    # what the target sent comes back to the caller, cut at the bound: 13 bytes sent, at most 10 carried
    assert relayed == b"relayed by"[: len(relayed)] and 0 < len(relayed) <= 10
    assert service.stats.bytes_relayed <= 10 + len(b"hello") and service.stats.refused["data_limit"] >= 1
    assert service.stats.circuits_open == 0 and not service.circuits


def test_a_target_that_refuses_is_a_failed_connection():
    service = RelayService(FakeDaemon(accept=False), RelayPolicy(offer=True), ANYONE)
    _run(service, A, hop_message(type=RESERVE))
    answer, _ = _run(service, B, hop_message(type=CONNECT, peer={"id": A.to_bytes()}))
    assert answer.status == 203  # CONNECTION_FAILED
    assert service.stats.circuits_open == 0


def test_slots_are_held_renewed_and_dropped_with_their_relay(monkeypatch):
    import peers.relay_slots as slots_module
    from peers.relay_slots import RENEW_S, RETRY_S, RelaySlots
    from swarm.circuit import Reservation

    r1, r2 = (f"/ip4/10.0.0.{i}/tcp/4001/p2p/{p}" for i, p in ((1, A), (2, B)))
    up = {r1: True, r2: False}
    asked: list[str] = []

    async def reserve(_p2p, relay):
        asked.append(relay)
        if not up[relay]:
            raise ConnectionError("relay down")
        return Reservation(expire=1, limit_s=0, limit_bytes=0)

    monkeypatch.setattr(slots_module, "reserve", reserve)
    clock = [0.0]
    slots = RelaySlots(None, (r1, r2), clock=lambda: clock[0])  # type: ignore[arg-type]
    assert asyncio.run(slots.renew()) is True and slots.held() == (r1,)
    assert slots.maddrs(str(C)) == [f"{r1}/p2p-circuit/p2p/{C}"]
    assert slots.next_due() == RETRY_S  # the relay that failed is asked again soon
    asked.clear()
    clock[0] = RETRY_S
    up[r2] = True
    assert asyncio.run(slots.renew()) is True and slots.held() == (r1, r2) and asked == [r2]  # r1 not yet due
    clock[0] = RETRY_S + RENEW_S
    up[r1] = False  # the first relay dies: its address leaves the peer's
    assert asyncio.run(slots.renew()) is True and slots.held() == (r2,)
    asked.clear()
    clock[0] += 0.5
    assert asyncio.run(slots.renew()) is False and asked == []  # nothing due: nobody asked


def _peer(i: int) -> PeerID:
    return PeerID(b"\x00\x05peer" + bytes([i]))  # an identity multihash: any bytes make a distinct id


class Members:
    """The DHT as the relay reads it: which peers have a fresh heartbeat, and how many reads were made."""

    def __init__(self, *peers: PeerID) -> None:
        self.ids = {p.to_base58() for p in peers}
        self.reads = 0
        self.gate: asyncio.Event | None = None  # set: reads wait on it (to hold lookups in flight)

    async def __call__(self, peer: str) -> bool:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        return peer in self.ids


def test_a_slot_goes_only_to_a_peer_whose_heartbeat_is_in_the_swarm():
    clock = [1000.0]
    members = Members(A)
    service = RelayService(FakeDaemon(), RelayPolicy(offer=True), Admission(members, clock=lambda: clock[0]))
    answer, _ = _run(service, B, hop_message(type=RESERVE))
    assert answer.status == 202 and service.stats.refused["no_record"] == 1 and not service.slots  # PERMISSION_DENIED
    _run(service, B, hop_message(type=RESERVE))  # asked again at once: refused from memory, no second read
    assert members.reads == 1 and service.stats.refused["no_record"] == 2
    clock[0] += REFUSED_S
    members.ids.add(B.to_base58())  # it heartbeats now
    assert _run(service, B, hop_message(type=RESERVE))[0].status == OK and members.reads == 2
    assert _run(service, A, hop_message(type=RESERVE))[0].status == OK and members.reads == 3
    _run(service, A, hop_message(type=RESERVE))  # a renewal soon after: no read
    assert members.reads == 3
    members.ids.discard(A.to_base58())  # A's heartbeat is missed by a read, or A left
    clock[0] += RECHECK_S
    assert _run(service, A, hop_message(type=RESERVE))[0].status == OK  # a holder found lately keeps its slot
    clock[0] += GRACE_S
    assert _run(service, A, hop_message(type=RESERVE))[0].status == 202  # gone for good: no renewal


def test_heartbeat_reads_are_bounded_whoever_asks():
    members = Members(*(_peer(i) for i in range(LOOKUPS + 1)))
    members.gate = asyncio.Event()
    service = RelayService(FakeDaemon(), RelayPolicy(offer=True, max_per_range=99), Admission(members))

    async def go() -> list[int]:
        outs = [Sink() for _ in range(LOOKUPS + 1)]
        tasks = [
            asyncio.create_task(service.handle(Info(_peer(i)), _reader(frame(hop_message(type=RESERVE))), outs[i]))
            for i in range(LOOKUPS)
        ]
        await asyncio.sleep(0.01)  # LOOKUPS reads in flight: the next caller is turned away without a read
        await service.handle(Info(_peer(LOOKUPS)), _reader(frame(hop_message(type=RESERVE))), outs[LOOKUPS])
        members.gate.set()
        await asyncio.gather(*tasks)
        return [_answer(out).status for out in outs]

    assert asyncio.run(go()) == [OK] * LOOKUPS + [201]  # RESOURCE_LIMIT_EXCEEDED
    assert members.reads == LOOKUPS and service.stats.refused["lookups_busy"] == 1


def test_one_address_range_holds_a_few_slots_not_all():
    service = RelayService(FakeDaemon(), RelayPolicy(offer=True, max_per_range=2), ANYONE)
    same = [f"/ip4/93.184.216.{i}/tcp/4001" for i in (1, 2, 3)]  # one /24
    for i, addr in enumerate(same[:2]):
        assert _run(service, _peer(i), hop_message(type=RESERVE), addr=addr)[0].status == OK
    answer, _ = _run(service, _peer(2), hop_message(type=RESERVE), addr=same[2])
    assert answer.status == 201 and service.stats.refused["range_full"] == 1
    assert _run(service, _peer(0), hop_message(type=RESERVE), addr=same[0])[0].status == OK  # renewals still go
    assert _run(service, _peer(3), hop_message(type=RESERVE), addr="/ip4/151.101.1.7/tcp/1")[0].status == OK
    # on a LAN each host is its own range
    for i, host in enumerate(("10.0.0.5", "10.0.0.6", "10.0.0.7")):
        assert _run(service, _peer(10 + i), hop_message(type=RESERVE), addr=f"/ip4/{host}/tcp/1")[0].status == OK


def test_address_ranges():
    assert address_range("/ip4/93.184.216.9/tcp/4001") == "93.184.216.0/24"
    assert address_range("/ip4/203.0.113.9/tcp/1") == "203.0.113.9"  # documentation range: not public
    assert address_range("/ip6/2001:4860:1:2::9/tcp/1") == "2001:4860:1::/48"
    assert address_range("/ip4/10.1.2.3/tcp/1") == "10.1.2.3"  # private: the host
    assert address_range("/ip4/127.0.0.1/tcp/1") == "127.0.0.1"
    assert address_range("/ip6/fe80::1/tcp/1") == "fe80::1"
    assert address_range("/dns4/example.org/tcp/1") == address_range("garbage") == "unknown"
