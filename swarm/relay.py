"""How a peer is reached behind a home router, as its p2p daemon is told: whether it is reachable from the internet
(asked of other peers by AutoNAT, or forced), whether it looks for relay peers to hold reservations on when it is
told it is not (auto-relay), and whether it offers relaying to others, within bounds. The p2p daemon in hivemind's
wheel does the relaying (circuit relay v2); it does not punch holes (no DCUtR in it), so a relayed connection stays
relayed.

Relaying is off unless asked for: p2pd's defaults would make every peer a relay for anyone (128 reservations, 16
circuits a peer, 4 GiB each way a circuit, 30 minutes), bytes and connections held for strangers that nothing here
would count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Reachability = Literal["auto", "public", "private"]
REACHABILITY: tuple[Reachability, ...] = ("auto", "public", "private")


@dataclass(frozen=True)
class RelayPolicy:
    """What this peer's p2p daemon does about NAT. ``offer``: serve as a relay for peers behind NAT, with at most
    ``max_reservations`` peers holding a slot, ``max_circuits`` relayed connections per peer, ``data_bytes`` each way
    per connection before it is reset, ``time_s`` per connection and ``buffer_bytes`` of buffer per connection."""

    reachability: Reachability = "auto"
    offer: bool = False
    max_reservations: int = 16
    max_circuits: int = 4
    data_bytes: int = 64 << 20
    time_s: int = 600
    buffer_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability is one of {', '.join(REACHABILITY)}, not {self.reachability!r}")
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

    def p2pd_flags(self) -> dict[str, int | str]:
        """p2pd's own flags hivemind does not pass: the relay service, on with its bounds, or off."""
        if not self.offer:
            return {"relayService": 0}
        return {
            "relayService": 1,
            "relayMaxReservations": self.max_reservations,
            "relayMaxCircuits": self.max_circuits,
            "relayDataLimit": self.data_bytes,
            "relayTimeLimit": f"{self.time_s}s",
            "relayBufferSize": self.buffer_bytes,
        }
