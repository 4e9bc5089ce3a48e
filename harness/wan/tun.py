"""TUN devices with TCP segmentation offload, and the few header fields the router reads.

Why offload: with a 1500-byte MTU a Python router would have to move ~8,000 packets/s per 100 Mbit/s. A jumbo MTU
cuts that, but then TCP's segments are jumbo too, so its initial window and its growth per RTT are ~45 times too
large and slow start is misrepresented. With ``IFF_VNET_HDR`` and TSO the kernel hands the router GSO super-packets
(up to 64 KiB, each a run of ordinary 1448-byte segments) behind a ``virtio_net_hdr``; the router forwards the
header and packet unchanged to the destination TUN, which accepts them as the same segments. TCP keeps a realistic
MSS while the router sees ~1,000 packets/s.
"""

from __future__ import annotations

import fcntl
import os
import struct

# <linux/if_tun.h>
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08

VNET_HDR_LEN = 10  # struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
MAX_READ = VNET_HDR_LEN + 65535 + 1024  # a GSO packet is at most 64 KiB of IP; the slack costs nothing
IFNAMSIZ = 16  # names are at most 15 characters and a NUL
IP_PROTO_TCP = 6
IP_PROTO_UDP = 17


def open_tun(name: str) -> int:
    """Create a non-persistent TUN device ``name`` with offloads on; return its fd (closing it removes the device)."""
    if len(name) >= IFNAMSIZ:
        raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ - 1} characters")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifreq = struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifreq)
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ipv4_dst(frame: bytes) -> bytes | None:
    """The IPv4 destination address (4 bytes) of a frame read from a TUN, or None for anything that is not IPv4."""
    if len(frame) < VNET_HDR_LEN + 20 or frame[VNET_HDR_LEN] >> 4 != 4:
        return None
    return frame[VNET_HDR_LEN + 16 : VNET_HDR_LEN + 20]


def wire_cost(frame: bytes) -> tuple[int, int]:
    """(bytes on the wire, segments) of a frame: a GSO packet is charged the IP and TCP/UDP headers of every
    segment it stands for, so a configured bandwidth means the same as on a link with a 1500-byte MTU."""
    ip_len = len(frame) - VNET_HDR_LEN
    gso_type, gso_size = frame[1], struct.unpack_from("<H", frame, 4)[0]  # x86/arm64: little-endian
    if gso_type == 0 or gso_size == 0 or ip_len < 20:
        return ip_len, 1
    ip = VNET_HDR_LEN
    ihl = (frame[ip] & 0x0F) * 4
    proto = frame[ip + 9]
    if proto == IP_PROTO_TCP and len(frame) >= ip + ihl + 13:
        headers = ihl + (frame[ip + ihl + 12] >> 4) * 4
    elif proto == IP_PROTO_UDP:
        headers = ihl + 8
    else:
        return ip_len, 1
    payload = max(ip_len - headers, 0)
    segments = max(-(-payload // gso_size), 1)
    return ip_len + (segments - 1) * headers, segments
