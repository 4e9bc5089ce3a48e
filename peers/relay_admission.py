"""Who may hold a slot on this relay: a peer of this swarm, few from one address range.

A relay's slots are few (``--relay-max-reservations``) and volunteers behind NAT cannot join without one, so they
go only to peers whose own signed heartbeat is in the swarm's DHT (the record every peer writes under its shard's
peers key; in a private swarm only members can write one, since the DHT speaks only with holders of the swarm key),
fresh and not leaving. The heartbeat is read from that one key, so a check costs one DHT read whatever the swarm's
size; at most ``LOOKUPS`` run at once, and a caller refused is not looked up again for ``REFUSED_S``, so a stream of
reservations from made-up identities costs the relay a bounded trickle of reads. A holder found once is not read
again for ``RECHECK_S``, and a renewal whose read misses is still granted for ``GRACE_S`` after the last read that
found it: a loaded DHT's read can miss a record, and a slot lost by mistake takes the peer's relayed address out of
its records. A peer that left stops being found and its slot lapses within ``GRACE_S`` plus a slot's life.

Identities cost nothing in an open swarm, so slots are also capped per address range (``address_range``): a public
IPv4 /24 or IPv6 /48 holds at most ``--relay-max-per-range`` slots, so one machine or one network's keys cannot take
every slot. Non-public addresses (loopback, private, link-local) only reach a relay that lives in that network, and
there each host is its own range."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
LOOKUPS = 4  # heartbeat reads in flight at once, all callers together
LOOKUP_S = 10.0  # one read (a DHT get over the internet)
REFUSED_S = 2.0  # a refused caller is answered from memory this long (``peers.relay_slots`` retries every 2 s)
RECHECK_S = 60.0  # an admitted holder's renewals within this are granted without a read
GRACE_S = 180.0  # a holder's renewal is granted this long after the last read that found its heartbeat
NO_RECORD, BUSY = "no_record", "lookups_busy"


def address_range(addr: str) -> str:
    """The range a caller's observed address (a multiaddr) counts against: a public IPv4 /24 or IPv6 /48, the host
    itself for a non-public address, and one shared range for anything that does not parse as IP."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return "unknown"
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return "unknown"
    if not ip.is_global:
        return str(ip)
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class Admission:
    """Whether a caller may hold a slot. ``lookup(peer_id)``: whether its fresh, signed heartbeat is in the swarm.
    ``clock`` is monotonic time."""

    def __init__(self, lookup: Callable[[str], Awaitable[bool]], clock: Callable[[], float] = time.monotonic) -> None:
        self.lookup, self.clock = lookup, clock
        self.found: dict[str, float] = {}  # peer -> when a read last found its heartbeat
        self.refused: dict[str, float] = {}  # peer -> until when it is refused without a read
        self.checking: set[str] = set()

    async def refusal(self, peer: str, holder: bool) -> str | None:
        """None if ``peer`` may hold (or, as a ``holder``, keep) a slot; else why not (``NO_RECORD``, ``BUSY``)."""
        now = self.clock()
        self._forget(now)
        if now - self.found.get(peer, -GRACE_S) < RECHECK_S:
            return None
        if peer in self.refused:
            return NO_RECORD
        if peer in self.checking or len(self.checking) >= LOOKUPS:
            return BUSY
        self.checking.add(peer)
        try:
            async with asyncio.timeout(LOOKUP_S):
                ok = await self.lookup(peer)
        except Exception as e:  # a DHT read that failed finds nothing
            log.debug("no heartbeat read for %s: %s", peer, e)
            ok = False
        finally:
            self.checking.discard(peer)
        now = self.clock()
        if ok:
            self.found[peer] = now
            return None
        if holder and now - self.found.get(peer, -GRACE_S) < GRACE_S:
            return None  # a read that missed: the holder was found lately
        self.refused[peer] = now + REFUSED_S
        return NO_RECORD

    def _forget(self, now: float) -> None:
        """Entries past use: both maps stay as small as the callers of the last few minutes."""
        for peer in [p for p, until in self.refused.items() if until <= now]:
            del self.refused[peer]
        for peer in [p for p, at in self.found.items() if now - at >= GRACE_S]:
            del self.found[peer]
