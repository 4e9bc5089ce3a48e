"""Home routers in the WAN emulator: network address translation as the router process applies it to each packet.

A NAT box has an outside address on the WAN and hides the addresses behind it (nodes, or other boxes: a home router
behind a carrier-grade NAT). A TCP or UDP packet leaving from behind it gets the box's address and a mapped port;
one arriving at the box's address is let in only to a mapping that exists and whose filter admits its sender, and
leaves with the inside address and port. The kinds, in RFC 4787's terms:

- ``full-cone``: one mapping per inside address and port (endpoint-independent), and anyone may send to it;
- ``restricted-cone``: the same mapping, only hosts the inside endpoint has sent to may answer;
- ``port-restricted``: the same mapping, only the very address and port it has sent to may answer;
- ``symmetric``: a mapping per destination (a new outside port for each), answered only by that destination;
- ``firewall``: no translation at all (the hosts behind it keep their own, routable addresses), but stateful: only
  the very address and port an inside endpoint has sent to may answer it, as a home router's firewall or a
  connection-tracking host firewall does with addresses that need no NAT (IPv6 at home, a rented server's VPC).

A mapping lives ``timeout_s`` after the last packet through it, each way. There is no hairpinning (a packet from
behind a box to that box's own outside address is dropped), as on many home routers. Everything here is pure: the
clock is passed in, and ``Nat`` keeps only its tables."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from harness.wan.tun import IP_PROTO_TCP, IP_PROTO_UDP, VNET_HDR_LEN

KINDS = ("full-cone", "restricted-cone", "port-restricted", "symmetric", "firewall")
FIREWALL = "firewall"
FIRST_PORT = 20000  # outside ports are handed out from here, one box at a time
VIRTIO_NET_HDR_F_NEEDS_CSUM = 1

Endpoint = tuple[bytes, int]  # (4-byte IPv4 address, port)


@dataclass
class _Mapping:
    inside: Endpoint
    port: int  # the outside port
    peers: set[Endpoint] = field(default_factory=set)  # who the inside endpoint has sent to
    last: float = 0.0


@dataclass
class NatBox:
    """One box: its outside address, its kind, and its mappings by protocol."""

    public: bytes
    kind: str
    timeout_s: float = 60.0
    out: dict[tuple[int, Endpoint, Endpoint | None], _Mapping] = field(default_factory=dict)
    back: dict[tuple[int, int], _Mapping] = field(default_factory=dict)
    next_port: int = FIRST_PORT

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"NAT kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def outbound(self, proto: int, src: Endpoint, dst: Endpoint, now: float) -> int:
        """The outside port ``src`` leaves by towards ``dst`` (a new mapping where there is none alive)."""
        key = (proto, src, dst if self.kind == "symmetric" else None)
        mapping = self.out.get(key)
        if mapping is None or now - mapping.last > self.timeout_s:
            if mapping is not None:
                self.back.pop((proto, mapping.port), None)
            mapping = _Mapping(src, self._port(proto))
            self.out[key] = mapping
            self.back[(proto, mapping.port)] = mapping
        mapping.peers.add(dst)
        mapping.last = now
        return mapping.port

    def allow_out(self, proto: int, src: Endpoint, dst: Endpoint, now: float) -> None:
        """A firewall's state for ``src`` sending to ``dst`` (nothing translated): ``dst`` may answer it now."""
        self.outbound(proto, src, dst, now)

    def allow_in(self, proto: int, dst: Endpoint, src: Endpoint, now: float) -> bool:
        """Whether a firewall lets ``src``'s packet in to ``dst``: only an answer to what ``dst`` sent ``src``."""
        mapping = self.out.get((proto, dst, None))
        if mapping is None or now - mapping.last > self.timeout_s or src not in mapping.peers:
            return False
        mapping.last = now
        return True

    def inbound(self, proto: int, port: int, src: Endpoint, now: float) -> Endpoint | None:
        """Where a packet from ``src`` to the box's ``port`` goes inside, or None where the box drops it."""
        mapping = self.back.get((proto, port))
        if mapping is None or now - mapping.last > self.timeout_s:
            return None
        if self.kind == "restricted-cone" and src[0] not in {ip for ip, _ in mapping.peers}:
            return None
        if self.kind in ("port-restricted", "symmetric") and src not in mapping.peers:
            return None
        mapping.last = now
        return mapping.inside

    def _port(self, proto: int) -> int:
        for _ in range(65536 - FIRST_PORT):
            port, self.next_port = self.next_port, FIRST_PORT + (self.next_port + 1 - FIRST_PORT) % (65536 - FIRST_PORT)
            held = self.back.get((proto, port))
            if held is None:
                return port
        raise RuntimeError("NAT box out of ports")  # 45,000 live mappings: not a test's traffic


class Nat:
    """Every box of a WAN, and which inside address sits behind which box."""

    def __init__(self, boxes: dict[bytes, NatBox], behind: dict[bytes, bytes]) -> None:
        self.boxes = boxes  # outside address -> box
        self.behind = behind  # inside address (a node's, or a box's outside one) -> the box's outside address

    def translate(self, frame: bytes, now: float) -> bytes | None:
        """``frame`` as it reaches the WAN's far side: out through every box above its sender, in through every box
        above its receiver; None where a box drops it (or it is neither TCP nor UDP and crosses a box)."""
        ip = VNET_HDR_LEN
        if len(frame) < ip + 20 or frame[ip] >> 4 != 4:
            return frame
        ihl = (frame[ip] & 0x0F) * 4
        proto = frame[ip + 9]
        src_ip, dst_ip = frame[ip + 12 : ip + 16], frame[ip + 16 : ip + 20]
        realm = self.behind.get  # the box an address is behind (None: the WAN itself)
        if realm(src_ip) == realm(dst_ip) and dst_ip not in self.boxes:  # the same network: no box crossed
            return frame
        if proto not in (IP_PROTO_TCP, IP_PROTO_UDP) or len(frame) < ip + ihl + 8:
            return None
        src_port, dst_port = struct.unpack_from("!HH", frame, ip + ihl)
        src, dst = (src_ip, src_port), (dst_ip, dst_port)
        at = realm(src_ip)  # the box the packet is behind now
        while at is not None and at not in self._above(dst_ip):  # out, box by box (home, carrier)
            box = self.boxes[at]
            if dst[0] == box.public:  # to its own outside address from inside: no hairpinning
                return None
            if box.kind == FIREWALL:
                box.allow_out(proto, src, dst, now)
            else:
                src = (box.public, box.outbound(proto, src, dst, now))
            at = realm(at)
        while True:  # in, box by box: the boxes between here and the address, then the one it names
            above = self._above(dst[0])
            if at not in above:  # an address behind a box this packet is not in
                return None
            between = [b for b in above[: above.index(at)] if b is not None]  # None is last: never below `at`
            for wall in reversed(between):  # outermost first
                box = self.boxes[wall]
                if box.kind != FIREWALL:  # an address behind a NAT, from outside it: nobody routes there
                    return None
                if not box.allow_in(proto, dst, src, now):
                    return None
            if dst[0] not in self.boxes or self.boxes[dst[0]].kind == FIREWALL:
                break
            inside = self.boxes[dst[0]].inbound(proto, dst[1], src, now)
            if inside is None:
                return None
            at, dst = dst[0], inside
        return rewrite(frame, src, dst) if (src, dst) != ((src_ip, src_port), (dst_ip, dst_port)) else frame

    def _above(self, address: bytes) -> list[bytes | None]:
        """The boxes ``address`` is behind, innermost first, ending with None (the WAN)."""
        chain: list[bytes | None] = []
        at = self.behind.get(address)
        while at is not None:
            chain.append(at)
            at = self.behind.get(at)
        chain.append(None)
        return chain


def _fold(x: int) -> int:
    while x >> 16:
        x = (x & 0xFFFF) + (x >> 16)
    return x


def _words(b: bytes) -> int:
    return sum(struct.unpack(f"!{len(b) // 2}H", b))


def _adjust(checksum: int, old: bytes, new: bytes, *, partial: bool) -> int:
    """RFC 1624's incremental update of a one's-complement checksum over ``old`` replaced by ``new`` (even
    lengths). ``partial``: the field holds the pseudo-header's sum itself, not its complement (checksum offload:
    the kernel completes it over the payload)."""
    delta = _words(bytes(~v & 0xFF for v in old)) + _words(new)
    if partial:
        return _fold(checksum + delta)
    return ~_fold((~checksum & 0xFFFF) + delta) & 0xFFFF


def rewrite(frame: bytes, src: Endpoint, dst: Endpoint) -> bytes:
    """``frame`` (virtio-net header, IPv4, TCP or UDP) with its source and destination set, checksums kept right."""
    out = bytearray(frame)
    ip = VNET_HDR_LEN
    ihl = (out[ip] & 0x0F) * 4
    proto = out[ip + 9]
    l4 = ip + ihl
    old_addrs, new_addrs = bytes(out[ip + 12 : ip + 20]), src[0] + dst[0]
    old_ports, new_ports = bytes(out[l4 : l4 + 4]), struct.pack("!HH", src[1], dst[1])
    (ip_sum,) = struct.unpack_from("!H", out, ip + 10)
    struct.pack_into("!H", out, ip + 10, _adjust(ip_sum, old_addrs, new_addrs, partial=False))
    out[ip + 12 : ip + 20] = new_addrs
    at = l4 + (16 if proto == IP_PROTO_TCP else 6)
    if len(out) >= at + 2:
        (l4_sum,) = struct.unpack_from("!H", out, at)
        partial = bool(out[0] & VIRTIO_NET_HDR_F_NEEDS_CSUM)
        if not (proto == IP_PROTO_UDP and l4_sum == 0 and not partial):  # UDP without a checksum stays without
            # the ports are in the sum only when the kernel does not complete it (the pseudo-header holds none)
            l4_sum = _adjust(l4_sum, old_addrs, new_addrs, partial=partial)
            if not partial:
                l4_sum = _adjust(l4_sum, old_ports, new_ports, partial=False)
            struct.pack_into("!H", out, at, l4_sum if l4_sum or partial or proto == IP_PROTO_TCP else 0xFFFF)
    out[l4 : l4 + 4] = new_ports
    return bytes(out)
