"""Broker election over a store without compare-and-set (the DHT), driven by an injected clock.

Every candidate writes its lease (term, holder, start of its tenure, expiry) under its own signed subkey, and every
reader resolves the lease it obeys with ``swarm.lease.LeaseView``: the live lease of the highest term, within a small
step of the last term it obeyed, kept while its holder renews it (a higher claim does not pre-empt it), ties broken
by a hash no candidate chooses. A candidate claims the next term only when no lease is live; the holder renews well
before expiry, for at most ``max_tenure``, and then sits out a term so others get a turn. Two peers may briefly both
believe they hold the role; what keeps the swarm safe is that an assignment counts only when signed by the holder
of the lease its follower obeys, for that term, and that followers refuse assignments that would harm the swarm
(``peers/follower.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from swarm.lease import LeaseRules, LeaseView, well_formed
from swarm.records import MAX_COUNT, Lease

__all__ = ["Election", "Lease", "LeaseStore"]


class LeaseStore(Protocol):
    def read(self) -> list[Lease]: ...

    def write(self, lease: Lease) -> None: ...


class Election:
    def __init__(self, me: str, store: LeaseStore, clock: Callable[[], float], rules: LeaseRules) -> None:
        self.me = me
        self.store = store
        self.clock = clock
        self.rules = rules
        self.view = LeaseView(rules)
        self.held: Lease | None = None

    def tick(self) -> Lease | None:
        """One round: renew, claim or stand by. Returns the lease this peer holds now, or None."""
        now = self.clock()
        leases = self.store.read()
        current = self.view.resolve(leases, now)
        if current is not None and current.holder == self.me:
            self.held = self._renewed(current, now)
            return self.held
        self.held = None
        if current is not None or self._resting(now):
            return None
        # A candidate that has obeyed no term yet starts above the well-formed ones it sees (never past the largest
        # term a record may carry: a forged lease at the limit must not make every claim invalid).
        known = [lease.term for lease in leases if well_formed(lease, now, self.rules) and lease.term < MAX_COUNT]
        term = (self.view.term if self.view.term is not None else max(known, default=0)) + 1
        self.store.write(Lease(term=term, holder=self.me, start=now, expires=now + self.rules.lease_seconds))
        # another candidate may have claimed the same term: everyone resolves the same winner on the next read
        resolved = self.view.resolve(self.store.read(), now)
        self.held = resolved if resolved is not None and resolved.holder == self.me else None
        return self.held

    def _renewed(self, lease: Lease, now: float) -> Lease:
        """Renew well before expiry, within the tenure: past it the lease lapses and someone else takes a turn."""
        if lease.expires - now >= self.rules.lease_seconds * 2 / 3:
            return lease
        expires = min(now + self.rules.lease_seconds, lease.start + self.rules.max_tenure)
        if expires <= lease.expires:
            return lease  # the tenure is over: let it lapse
        renewed = Lease(term=lease.term, holder=self.me, start=lease.start, expires=expires)
        self.store.write(renewed)
        self.view.current = renewed
        return renewed

    def _resting(self, now: float) -> bool:
        """After a full tenure, a holder sits out one lease period (the readers refuse its claim meanwhile)."""
        ended = self.view.finished.get(self.me)
        return ended is not None and now - ended < self.rules.lease_seconds
