"""Broker election over a store without compare-and-set (the DHT), driven by an injected clock.

Every candidate writes a lease (holder, term, expiry) under its own signed subkey; every reader resolves the same
winner from what it reads: the unexpired lease with the highest term, ties to the smallest holder id. A candidate
claims term+1 only when no unexpired lease is left; the holder renews before expiry. Two peers may briefly both
believe they hold the role; what keeps the swarm safe is that assignments carry (term, broker) and followers obey
only the highest they have seen (``newest_assignment``), so a broker cut off and back cannot undo its successor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, order=True)
class Lease:
    term: int
    holder: str
    expires: float

    def valid(self, now: float) -> bool:
        return self.expires > now


def winner(leases: Iterable[Lease], now: float) -> Lease | None:
    live = [lease for lease in leases if lease.valid(now)]
    if not live:
        return None
    top = max(lease.term for lease in live)
    return min((lease for lease in live if lease.term == top), key=lambda lease: lease.holder)


def newest_assignment(items: Iterable[tuple[int, str]], seen: tuple[int, str] | None) -> tuple[int, str] | None:
    """Of (term, broker) stamps, the one a follower obeys: the highest term (ties: smallest broker id), and never
    one older than what it already obeyed."""
    best = seen
    for term, broker in items:
        if best is None or term > best[0] or (term == best[0] and broker < best[1]):
            best = (term, broker)
    return best


class LeaseStore(Protocol):
    def read(self) -> list[Lease]: ...

    def write(self, lease: Lease) -> None: ...


class Election:
    def __init__(self, me: str, store: LeaseStore, clock: Callable[[], float], lease_seconds: float) -> None:
        self.me = me
        self.store = store
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.held: Lease | None = None

    def tick(self) -> Lease | None:
        """One round: renew, claim or stand by. Returns the lease this peer holds now, or None."""
        now = self.clock()
        current = winner(self.store.read(), now)
        if current is not None and current.holder == self.me:
            if current.expires - now < self.lease_seconds * 2 / 3:  # renew well before expiry
                current = Lease(current.term, self.me, now + self.lease_seconds)
                self.store.write(current)
            self.held = current
            return current
        if current is None:
            seen = [lease.term for lease in self.store.read()]
            claim = Lease(max(seen, default=0) + 1, self.me, now + self.lease_seconds)
            self.store.write(claim)
            # another candidate may have claimed the same term: everyone resolves the same winner on the next read
            resolved = winner(self.store.read(), now)
            self.held = resolved if resolved is not None and resolved.holder == self.me else None
            return self.held
        self.held = None
        return None
