"""The WAN emulator's NAT boxes (``harness.wan.nat``): each kind's mapping and filtering, timeouts, a double NAT, and
packets rewritten with checksums a receiver accepts (full ones, and the partial ones of checksum offload)."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.wan.nat import VIRTIO_NET_HDR_F_NEEDS_CSUM, Nat, NatBox, rewrite
from harness.wan.tun import IP_PROTO_TCP, IP_PROTO_UDP, VNET_HDR_LEN

HOME, CARRIER, SERVER, OTHER, LAPTOP = (socket.inet_aton(f"10.77.0.{i}") for i in (100, 101, 1, 2, 3))


def _sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _pseudo(src: bytes, dst: bytes, proto: int, length: int) -> bytes:
    return src + dst + struct.pack("!BBH", 0, proto, length)


def packet(src: tuple[bytes, int], dst: tuple[bytes, int], proto: int, payload: bytes, partial: bool = False) -> bytes:
    """A frame as a TUN gives it: virtio-net header, IPv4 header, TCP or UDP header, payload, right checksums."""
    l4 = (
        struct.pack("!HHIIBBHHH", src[1], dst[1], 1, 0, 5 << 4, 0x18, 65535, 0, 0)
        if proto == IP_PROTO_TCP
        else struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0)
    )
    segment = bytearray(l4 + payload)
    at = 16 if proto == IP_PROTO_TCP else 6
    pseudo = _sum(_pseudo(src[0], dst[0], proto, len(segment)))
    if partial:  # offload: the field holds the pseudo-header's sum; the kernel completes it
        struct.pack_into("!H", segment, at, pseudo)
    else:
        struct.pack_into("!H", segment, at, ~_sum(_pseudo(src[0], dst[0], proto, len(segment)) + segment) & 0xFFFF)
    header = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 0, 0, 64, proto, 0, src[0], dst[0]))
    struct.pack_into("!H", header, 10, ~_sum(bytes(header)) & 0xFFFF)
    vnet = struct.pack("<BBHHHH", VIRTIO_NET_HDR_F_NEEDS_CSUM if partial else 0, 0, 0, 0, 20, at)
    return vnet + bytes(header) + bytes(segment)


def parts(frame: bytes) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
    ip = VNET_HDR_LEN
    sport, dport = struct.unpack_from("!HH", frame, ip + 20)
    return (frame[ip + 12 : ip + 16], sport), (frame[ip + 16 : ip + 20], dport)


def checksums_hold(frame: bytes) -> bool:
    ip = VNET_HDR_LEN
    proto, (src, _), (dst, _) = frame[ip + 9], *parts(frame)
    segment = frame[ip + 20 :]
    if _sum(frame[ip : ip + 20]) != 0xFFFF:
        return False
    at = 16 if proto == IP_PROTO_TCP else 6
    if frame[0] & VIRTIO_NET_HDR_F_NEEDS_CSUM:
        (field,) = struct.unpack_from("!H", segment, at)
        return field == _sum(_pseudo(src, dst, proto, len(segment)))
    return _sum(_pseudo(src, dst, proto, len(segment)) + segment) == 0xFFFF


addresses = st.binary(min_size=4, max_size=4)
ports = st.integers(1, 65535)


@given(
    st.tuples(addresses, ports),
    st.tuples(addresses, ports),
    st.tuples(addresses, ports),
    st.tuples(addresses, ports),
    st.sampled_from([IP_PROTO_TCP, IP_PROTO_UDP]),
    st.binary(max_size=300),
    st.booleans(),
)
def test_a_rewritten_packet_keeps_checksums_a_receiver_accepts(a, b, c, d, proto, payload, partial):
    frame = packet(a, b, proto, payload, partial)
    assert checksums_hold(frame)
    out = rewrite(frame, c, d)
    body = VNET_HDR_LEN + 20 + (20 if proto == IP_PROTO_TCP else 8)
    assert parts(out) == (c, d) and out[body:] == frame[body:] == payload
    assert checksums_hold(out), (a, b, c, d)


def _nat(kind: str, timeout_s: float = 60.0) -> Nat:
    return Nat({HOME: NatBox(HOME, kind, timeout_s)}, {LAPTOP: HOME})


def _out(nat: Nat, dst: tuple[bytes, int], now: float = 0.0, src_port: int = 4001) -> tuple[bytes, int]:
    frame = nat.translate(packet((LAPTOP, src_port), dst, IP_PROTO_UDP, b"hello"), now)
    assert frame is not None and checksums_hold(frame)
    src, to = parts(frame)
    assert to == dst and src[0] == HOME
    return src


def _in(nat: Nat, src: tuple[bytes, int], mapped: tuple[bytes, int], now: float = 0.0) -> tuple[bytes, int] | None:
    frame = nat.translate(packet(src, mapped, IP_PROTO_UDP, b"reply"), now)
    if frame is None:
        return None
    assert checksums_hold(frame) and parts(frame)[0] == src
    return parts(frame)[1]


@pytest.mark.parametrize(
    "kind, same_mapping, stranger, other_port_same_host",
    [
        ("full-cone", True, True, True),
        ("restricted-cone", True, False, True),
        ("port-restricted", True, False, False),
        ("symmetric", False, False, False),
    ],
)
def test_each_kind_maps_and_filters_as_rfc_4787_names_it(kind, same_mapping, stranger, other_port_same_host):
    nat = _nat(kind)
    assert _in(nat, (SERVER, 443), (HOME, 20000)) is None  # nothing asked for it: dropped
    mapped = _out(nat, (SERVER, 443))
    assert (_out(nat, (OTHER, 80)) == mapped) is same_mapping  # the mapping towards a second host
    assert _in(nat, (SERVER, 443), mapped) == (LAPTOP, 4001)  # the host it sent to answers
    assert (_in(nat, (OTHER, 9), mapped) is not None) is (stranger or (same_mapping and kind == "restricted-cone"))
    assert (_in(nat, (SERVER, 444), mapped) is not None) is other_port_same_host
    assert _in(nat, (LAPTOP, 1), (HOME, 65000)) is None  # no mapping on that port


def test_a_mapping_expires_after_its_timeout_and_traffic_keeps_it():
    nat = _nat("port-restricted", timeout_s=30.0)
    mapped = _out(nat, (SERVER, 443), now=0.0)
    assert _in(nat, (SERVER, 443), mapped, now=29.0) == (LAPTOP, 4001)  # an answer refreshes it
    assert _in(nat, (SERVER, 443), mapped, now=58.0) == (LAPTOP, 4001)
    assert _in(nat, (SERVER, 443), mapped, now=89.0) is None  # 31 s idle: gone
    again = _out(nat, (SERVER, 443), now=90.0)
    assert again != mapped  # a new mapping, on a new port


def test_a_double_nat_translates_twice_and_admits_only_answers():
    nat = Nat(
        {HOME: NatBox(HOME, "full-cone"), CARRIER: NatBox(CARRIER, "port-restricted")},
        {LAPTOP: HOME, HOME: CARRIER},
    )
    frame = nat.translate(packet((LAPTOP, 5000), (SERVER, 443), IP_PROTO_TCP, b"x" * 40), 0.0)
    assert frame is not None and checksums_hold(frame)
    (src_ip, src_port), _ = parts(frame)
    assert src_ip == CARRIER  # the WAN sees the carrier's address only
    back = nat.translate(packet((SERVER, 443), (CARRIER, src_port), IP_PROTO_TCP, b"y"), 1.0)
    assert back is not None and checksums_hold(back) and parts(back)[1] == (LAPTOP, 5000)
    assert nat.translate(packet((OTHER, 443), (CARRIER, src_port), IP_PROTO_TCP, b"z"), 1.0) is None
    # the home router's own mapping is full-cone, but its address is the carrier's inside: nobody outside reaches it
    assert nat.translate(packet((SERVER, 443), (HOME, 20000), IP_PROTO_TCP, b"z"), 1.0) is None
    assert nat.translate(packet((SERVER, 443), (LAPTOP, 5000), IP_PROTO_TCP, b"z"), 1.0) is None


def test_no_hairpinning_and_no_other_protocols_across_a_box():
    nat = _nat("full-cone")
    mapped = _out(nat, (SERVER, 443))
    assert nat.translate(packet((LAPTOP, 4002), mapped, IP_PROTO_UDP, b"me"), 0.0) is None
    icmp = bytearray(packet((LAPTOP, 1), (SERVER, 1), IP_PROTO_UDP, b"ping"))
    icmp[VNET_HDR_LEN + 9] = 1
    assert nat.translate(bytes(icmp), 0.0) is None
    plain = packet((SERVER, 1), (OTHER, 2), IP_PROTO_TCP, b"public to public")
    assert nat.translate(plain, 0.0) == plain  # crossing no box: untouched


def test_a_firewall_translates_nothing_and_admits_only_answers():
    """A stateful firewall without NAT: the host keeps its own address both ways; only the very endpoint it sent to
    gets in, and a firewall inside a NAT is crossed as well as the NAT."""
    nat = _nat("firewall")
    assert _in(nat, (SERVER, 443), (LAPTOP, 4001)) is None  # unsolicited: dropped
    frame = nat.translate(packet((LAPTOP, 4001), (SERVER, 443), IP_PROTO_TCP, b"syn"), 0.0)
    assert frame is not None and parts(frame) == ((LAPTOP, 4001), (SERVER, 443))  # untranslated
    assert nat.translate(packet((SERVER, 443), (LAPTOP, 4001), IP_PROTO_TCP, b"ack"), 1.0) is not None
    assert nat.translate(packet((SERVER, 444), (LAPTOP, 4001), IP_PROTO_TCP, b"x"), 1.0) is None
    assert nat.translate(packet((OTHER, 443), (LAPTOP, 4001), IP_PROTO_TCP, b"x"), 1.0) is None
    assert nat.translate(packet((SERVER, 443), (LAPTOP, 4002), IP_PROTO_TCP, b"x"), 1.0) is None
    behind = Nat({HOME: NatBox(HOME, "firewall"), CARRIER: NatBox(CARRIER, "full-cone")}, {LAPTOP: HOME, HOME: CARRIER})
    out = behind.translate(packet((LAPTOP, 5000), (SERVER, 443), IP_PROTO_TCP, b"x"), 0.0)
    assert out is not None and parts(out)[0][0] == CARRIER
    mapped = parts(out)[0]
    assert behind.translate(packet((SERVER, 443), mapped, IP_PROTO_TCP, b"y"), 0.0) is not None
    # the full-cone NAT would let a stranger in; the firewall behind it does not
    assert behind.translate(packet((OTHER, 443), mapped, IP_PROTO_TCP, b"y"), 0.0) is None
