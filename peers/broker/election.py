"""Broker election over a store without compare-and-set (the DHT), driven by an injected clock.

Every candidate writes a lease (holder, term, expiry) under its own signed subkey; every reader resolves the same
winner from what it reads: the unexpired lease with the highest term, ties to the smallest holder id. A candidate
claims term+1 only when no unexpired lease is left; the holder renews before expiry. Two peers may briefly both
believe they hold the role; what keeps the swarm safe is that assignments carry (term, broker) and followers obey
only the highest they have seen (``newest_assignment``), so a broker cut off and back cannot undo its successor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from swarm.lease import newest_assignment, winner
from swarm.records import Lease

__all__ = ["Election", "Lease", "LeaseStore", "newest_assignment", "winner"]


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
        self.max_term = 0  # highest term ever seen here: terms only grow, even if old leases vanish from the store

    def tick(self) -> Lease | None:
        """One round: renew, claim or stand by. Returns the lease this peer holds now, or None."""
        now = self.clock()
        leases = self.store.read()
        self.max_term = max([self.max_term, *(lease.term for lease in leases)])
        current = winner(leases, now)
        if current is not None and current.holder == self.me and (self.held is None or self.held.term != current.term):
            current = None  # a leftover claim of ours that lost a tie earlier: take over with a fresh term instead
        if current is not None and current.holder == self.me:
            if current.expires - now < self.lease_seconds * 2 / 3:  # renew well before expiry
                current = Lease(term=current.term, holder=self.me, expires=now + self.lease_seconds)
                self.store.write(current)
            self.held = current
            return current
        if current is None:
            claim = Lease(term=self.max_term + 1, holder=self.me, expires=now + self.lease_seconds)
            self.max_term = claim.term
            self.store.write(claim)
            # another candidate may have claimed the same term: everyone resolves the same winner on the next read
            resolved = winner(self.store.read(), now)
            self.held = resolved if resolved is not None and resolved.holder == self.me else None
            return self.held
        self.held = None
        return None
