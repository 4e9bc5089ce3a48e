"""How a peer is reached behind a home router, as its p2p daemon is told: whether it is reachable from the internet
(asked of other peers by AutoNAT, or forced), whether it looks for relay peers to hold reservations on when it is
told it is not (auto-relay), and whether it offers relaying to others, within bounds. The p2p daemon in hivemind's
wheel does the relaying (circuit relay v2); it does not punch holes (no DCUtR in it), so a relayed connection stays
relayed.

A peer told it is private reserves a slot on the relays it is given (``relays``: by default the peers it joins
through), as p2pd's static relays: it holds a reservation within seconds of start (measured: 10-14 s behind an
emulated port-restricted NAT, docs/links.md), where p2pd's own relay finder waits 3 minutes for 4 candidates. Its
records then carry its relayed addresses (``relayed_maddrs``: the relay's address, ``/p2p-circuit``, its own id),
which p2pd never reports, and ``dial_addr`` encodes such an address the way p2pd reads it.

Relaying is off unless asked for: p2pd's defaults would make every peer a relay for anyone (128 reservations, 16
circuits a peer, 4 GiB each way a circuit, 30 minutes), bytes and connections held for strangers that nothing here
would count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import base58
from hivemind.utils.multiaddr import Multiaddr

from swarm.records import Reached

Reachability = Literal["auto", "public", "private"]
REACHABILITY: tuple[Reachability, ...] = ("auto", "public", "private")
CIRCUIT = "/p2p-circuit"
_P2P_CODE, _CIRCUIT_CODE = 421, 290  # multiaddr protocol codes of /p2p and /p2p-circuit
MAX_RELAYS = 8


@dataclass(frozen=True)
class RelayPolicy:
    """What this peer's p2p daemon does about NAT. ``offer``: serve as a relay for peers behind NAT, with at most
    ``max_reservations`` peers holding a slot, ``max_circuits`` relayed connections per peer, ``data_bytes`` each way
    per connection before it is reset, ``time_s`` per connection and ``buffer_bytes`` of buffer per connection.
    ``relays``: where a private peer reserves its slots (full addresses, ``.../p2p/ID``)."""

    reachability: Reachability = "auto"
    offer: bool = False
    max_reservations: int = 16
    max_circuits: int = 4
    data_bytes: int = 64 << 20
    time_s: int = 600
    buffer_bytes: int = 64 << 10
    relays: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability is one of {', '.join(REACHABILITY)}, not {self.reachability!r}")
        if len(self.relays) > MAX_RELAYS:
            raise ValueError(f"at most {MAX_RELAYS} relays, got {len(self.relays)}")
        for relay in self.relays:
            if CIRCUIT in relay or relay_peer(relay) is None:
                raise ValueError(f"a relay is a peer's full address (/ip4/.../tcp/PORT/p2p/ID), not {relay!r}")
        for name in ("max_reservations", "max_circuits", "data_bytes", "time_s", "buffer_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"relay bound {name} must be positive, got {getattr(self, name)}")

    def hivemind_kwargs(self) -> dict[str, object]:
        """What hivemind's ``P2P.create`` takes of this: reachability and whether to look for relays."""
        # auto-relay only where the peer is told it is private: p2pd's reserves nothing for its first 3 minutes
        # with fewer than 4 relays known and reports no relayed address after (docs/links.md), so it buys a peer
        # that may well be public nothing but connections
        out: dict[str, object] = {"use_relay": True, "use_auto_relay": self.reachability == "private"}
        if self.reachability != "auto":
            out["force_reachability"] = self.reachability
        return out

    @property
    def reached(self) -> Reached:
        reached: dict[Reachability, Reached] = {"public": "public", "private": "relayed", "auto": "unmeasured"}
        return reached[self.reachability]

    @property
    def dht_client(self) -> bool:
        """Whether this peer's DHT runs in client mode: a private peer's cannot be dialled for DHT requests (others
        would keep it in their routing tables and wait on it)."""
        return self.reachability == "private"

    def relayed_maddrs(self, peer_id: str) -> tuple[str, ...]:
        """This peer's addresses through its relays (what its records announce when it is private)."""
        return tuple(f"{relay}{CIRCUIT}/p2p/{peer_id}" for relay in self.relays)

    def p2pd_flags(self) -> dict[str, int | str]:
        """p2pd's own flags hivemind does not pass: the relay service, on with its bounds, or off; a private peer's
        static relays."""
        flags: dict[str, int | str] = {}
        if self.reachability == "private" and self.relays:
            flags["trustedRelays"] = ",".join(self.relays)
        if not self.offer:
            return {**flags, "relayService": 0}
        return {
            **flags,
            "relayService": 1,
            "relayMaxReservations": self.max_reservations,
            "relayMaxCircuits": self.max_circuits,
            "relayDataLimit": self.data_bytes,
            "relayTimeLimit": f"{self.time_s}s",
            "relayBufferSize": self.buffer_bytes,
        }


def relay_peer(maddr: str) -> str | None:
    """The peer id a full address ends with (``.../p2p/ID``), or None."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 3 and parts[-2] == "p2p" and parts[-1] else None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _Encoded:
    """A multiaddr as bytes p2pd's ``connect`` takes (what ``Multiaddr.to_bytes`` gives, for hivemind's calls)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


def dial_addr(maddr: str) -> Multiaddr | _Encoded:
    """``maddr`` as p2pd's ``connect`` reads it. A plain address loses its ``/p2p/ID`` (the peer goes beside it);
    a relayed one keeps the relay's id, encoded as the bare multihash go-multiaddr expects (hivemind's Python
    multiaddr writes peer ids as CIDs, which p2pd rejects: "length greater than remaining number of bytes")."""
    if CIRCUIT not in maddr:
        return Multiaddr(maddr.split("/p2p/")[0])
    relay = maddr.split(CIRCUIT)[0]
    peer = relay_peer(relay)
    if peer is None:
        raise ValueError(f"a relayed address names its relay's peer id before {CIRCUIT}: {maddr!r}")
    digest = base58.b58decode(peer)
    head = Multiaddr(relay.split("/p2p/")[0]).to_bytes()
    return _Encoded(head + _varint(_P2P_CODE) + _varint(len(digest)) + digest + _varint(_CIRCUIT_CODE))
