"""Who the broker is, as each reader resolves it from the leases in the DHT (see peers/broker/election.py for how
candidates compete), and whose assignment a follower obeys.

Leases are signed by their holders (``swarm.dht`` drops any other), so a lease can only be forged by its own
holder: the rules below bound what a candidate, honest or not, can do with its own leases.

- **Well-formed**: it started no later than it expires, expires at most one lease period (plus clock skew) from
  now, so its holder must stay alive and renew it, and one holder's tenure (``expires - start``) is bounded, so
  the role rotates.
- **No leap in terms**: a reader that has obeyed term ``t`` refuses a lease of a term above ``t + term_step``, so a
  lease with a huge term silences nobody.
- **No pre-emption**: a reader keeps obeying its lease while that lease is live (renewed by its holder); a claim of a
  higher term takes effect only once it lapses.
- **Ties** (two claims of one term) go to the smaller hash of the term, every contender's id and the holder's id,
  which no single candidate chooses; the smallest peer id could be ground for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from swarm.records import Assignment, Lease


@dataclass(frozen=True)
class LeaseRules:
    lease_seconds: float
    max_tenure: float  # longest one holder may renew its lease before others get a turn
    term_step: int = 2  # a new term may be at most this far above the last one a reader obeyed
    skew: float = 2.0  # clock difference tolerated between peers, seconds


def well_formed(lease: Lease, now: float, rules: LeaseRules) -> bool:
    return (
        lease.term >= 1
        and lease.start <= lease.expires <= now + rules.lease_seconds + rules.skew
        and lease.start <= now + rules.skew
        and lease.expires - lease.start <= rules.max_tenure + rules.skew
    )


def tie_break(lease: Lease, contenders: Iterable[str]) -> str:
    everyone = ",".join(sorted(set(contenders)))
    return hashlib.sha256(f"{lease.term}|{everyone}|{lease.holder}".encode()).hexdigest()


def winner(leases: Iterable[Lease], now: float, rules: LeaseRules, floor: int | None = None) -> Lease | None:
    """The live, well-formed lease of the highest term (at most ``floor + term_step`` when the reader has obeyed
    term ``floor``), ties broken by ``tie_break``."""
    live = [
        lease
        for lease in leases
        if lease.expires > now
        and well_formed(lease, now, rules)
        and (floor is None or lease.term <= floor + rules.term_step)
    ]
    if not live:
        return None
    top = max(lease.term for lease in live)
    contenders = [lease for lease in live if lease.term == top]
    holders = [lease.holder for lease in contenders]
    return min(contenders, key=lambda lease: tie_break(lease, holders))


@dataclass
class LeaseView:
    """One reader's view of the broker role: the lease it obeys, kept while it is live (no pre-emption), and the
    highest term it has obeyed (no leap in terms)."""

    rules: LeaseRules
    current: Lease | None = None
    term: int | None = None  # the highest term obeyed so far
    finished: dict[str, float] = field(default_factory=dict)  # holder -> when its tenure ran out
    lapsed_at: float | None = None  # when the last lease it obeyed lapsed: only claims made since then count

    def resolve(self, leases: list[Lease], now: float) -> Lease | None:
        current = self.current
        if current is not None:
            # a renewal keeps the tenure's start: a holder that restamped it would never reach ``max_tenure``
            same = (current.holder, current.term, current.start)
            renewed = [
                lease
                for lease in leases
                if (lease.holder, lease.term, lease.start) == same
                and lease.expires > now
                and well_formed(lease, now, self.rules)
            ]
            if renewed:
                self.current = max(renewed, key=lambda lease: lease.expires)
                return self.current
            if current.expires - current.start >= self.rules.max_tenure - self.rules.lease_seconds:
                self.finished[current.holder] = now  # its tenure ran out: it sits out the next term
            self.lapsed_at = current.expires
        resting = {h for h, t in self.finished.items() if now - t < self.rules.lease_seconds}
        # A claim counts only if made once the lease it follows had lapsed: one kept waiting through another's tenure
        # (at a higher term) would otherwise take the role the moment that tenure ends.
        eligible = [
            lease
            for lease in leases
            if (lease.holder not in resting or lease.term == self.term)
            and (self.lapsed_at is None or lease.start >= self.lapsed_at - self.rules.skew)
        ]
        found = winner(eligible, now, self.rules, self.term)
        self.current = found
        if found is not None:
            self.term = max(self.term or 0, found.term)
        return found

    def obeys(self, assignment: Assignment) -> bool:
        """An assignment counts only when the holder of the lease this reader obeys signed it, for that term."""
        current = self.current
        return current is not None and (assignment.term, assignment.broker) == (current.term, current.holder)
