"""Who the broker is, as every reader resolves it from the leases in the DHT (see peers/broker/election.py for
how peers compete), and which broker's assignment a follower obeys."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.records import Lease


def winner(leases: Iterable[Lease], now: float) -> Lease | None:
    """The unexpired lease with the highest term; ties go to the smallest holder id."""
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
