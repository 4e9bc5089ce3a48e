"""How a peer is reached behind a home router: whether it is reachable from the internet (asked of other peers by
AutoNAT, or forced), where it holds relay slots when it is not, and whether it relays for others, within bounds.

The p2p daemon in hivemind's wheel carries circuit relay v2 but is no use left to itself here: its relay finder
holds no slot for 3 minutes with fewer than 4 relays known, static ones included, and its relay service ignores
the bounds its flags give (go-libp2p's defaults win: 128 KiB and 2 minutes a connection, for anyone; measured,
docs/links.md). So the relay protocol is the swarm's: a peer told it is private reserves slots itself on the
relays it is given (``relays``: by default the peers it joins through; ``peers.relay_slots``), and a peer that
offers relaying answers the protocol itself within these bounds (``peers.relay_service``); every other daemon has
it taken off (``swarm.circuit.take_hop``). A private peer's records carry its relayed addresses
(``relayed_maddrs``: the relay's address, ``/p2p-circuit``, its own id), which p2pd never reports, and
``dial_addr`` encodes such an address the way p2pd reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import base58
from hivemind.utils.multiaddr import Multiaddr

from swarm.circuit import varint
from swarm.records import Reached

Reachability = Literal["auto", "public", "private"]
REACHABILITY: tuple[Reachability, ...] = ("auto", "public", "private")
CIRCUIT = "/p2p-circuit"
_P2P_CODE, _CIRCUIT_CODE = 421, 290  # multiaddr protocol codes of /p2p and /p2p-circuit
MAX_RELAYS = 8


@dataclass(frozen=True)
class RelayPolicy:
    """What this peer's p2p daemon does about NAT. ``offer``: serve as a relay for peers behind NAT, with at most
    ``max_reservations`` peers holding a slot (at most ``max_per_range`` from one address range), ``max_circuits``
    relayed connections per peer, ``data_bytes`` each way per connection before it is reset, ``time_s`` per
    connection and ``buffer_bytes`` of buffer per connection. ``relays``: where a private peer reserves its slots
    (full addresses, ``.../p2p/ID``)."""

    reachability: Reachability = "auto"
    offer: bool = False
    max_reservations: int = 16
    max_per_range: int = 4
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
        for name in ("max_reservations", "max_per_range", "max_circuits", "data_bytes", "time_s", "buffer_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"relay bound {name} must be positive, got {getattr(self, name)}")

    def hivemind_kwargs(self) -> dict[str, object]:
        """What hivemind's ``P2P.create`` takes of this: reachability and whether to look for relays."""
        # relaying stays on (dialling and accepting relayed connections need it); p2pd's auto-relay stays off: it
        # reserves nothing for its first 3 minutes and reports nothing after, where ``peers.relay_slots`` reserves
        # at once and knows what it holds
        out: dict[str, object] = {"use_relay": True, "use_auto_relay": False}
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
        """p2pd's own flags hivemind does not pass: no configured relay service (its bounds would not hold anyway;
        the relay protocol is answered by the swarm's code or by nobody)."""
        return {"relayService": 0}


def relay_peer(maddr: str) -> str | None:
    """The peer id a full address ends with (``.../p2p/ID``), or None."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 3 and parts[-2] == "p2p" and parts[-1] else None


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
    return _Encoded(head + varint(_P2P_CODE) + varint(len(digest)) + digest + varint(_CIRCUIT_CODE))
