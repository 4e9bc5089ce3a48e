"""A peer behind NAT holds slots on its relays itself, so that it is reachable seconds after start, not minutes.

p2pd's own relay finder waits out a 3-minute boot delay before its first reservation when it knows fewer than 4
relays, static ones included (measured, docs/links.md), and never says what it holds. So the node reserves on the
relays it is given (``RelayPolicy.relays``) with circuit v2's ``RESERVE`` (``swarm.circuit``), sent on a stream of
its own daemon's connection to each relay: the relay puts strangers through to it over that connection. Slots are
renewed every ``RENEW_S``; a relay that stops answering loses its place in the peer's addresses (``maddrs``) until it
answers again, so records name only relays that hold a slot now."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hivemind.p2p import P2P, PeerID

from swarm.circuit import HOP, Reservation, parse_reservation, read_frame, reserve_request
from swarm.relay import CIRCUIT, dial_addr, relay_peer

log = logging.getLogger(__name__)
RENEW_S = 30.0  # well inside a slot's life (2 minutes at our relays), and how soon a dead relay is noticed
RETRY_S = 2.0  # a relay that refused or did not answer is asked again this soon
TRY_S = 10.0  # one connect and reservation (a few round trips over the internet)


async def reserve(p2p: P2P, relay: str, timeout: float = TRY_S) -> Reservation:
    """A slot on ``relay`` (a full address), through this peer's daemon."""
    peer = PeerID.from_base58(relay_peer(relay) or "")
    async with asyncio.timeout(timeout):
        await p2p._client.connect(peer, [dial_addr(relay)])
        _, reader, writer = await p2p._client.stream_open(peer, [HOP])
        try:
            writer.write(reserve_request())
            await writer.drain()
            return parse_reservation(await read_frame(reader))
        finally:
            writer.close()


class RelaySlots:
    """The slots one peer holds: which relays, renewed when. ``clock`` is monotonic time."""

    def __init__(self, p2p: P2P, relays: tuple[str, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.p2p, self.relays, self.clock = p2p, relays, clock
        self.due: dict[str, float] = {}  # relay held -> when to renew
        self.failed: dict[str, float] = {}  # relay not held -> when to ask again

    def held(self) -> tuple[str, ...]:
        return tuple(r for r in self.relays if r in self.due)

    def maddrs(self, peer_id: str) -> list[str]:
        """This peer's addresses through the relays that hold a slot for it."""
        return [f"{relay}{CIRCUIT}/p2p/{peer_id}" for relay in self.held()]

    async def renew(self) -> bool:
        """Reserve where a slot is due or missing; whether the set of relays held changed."""
        before = self.held()
        now = self.clock()
        due = [r for r in self.relays if self.due.get(r, self.failed.get(r, now)) <= now]
        results = await asyncio.gather(*(reserve(self.p2p, r) for r in due), return_exceptions=True)
        for relay, got in zip(due, results, strict=True):
            if isinstance(got, BaseException):
                if relay in self.due:
                    log.warning("lost the relay slot", extra={"relay": relay, "error": str(got)})
                self.due.pop(relay, None)
                self.failed[relay] = self.clock() + RETRY_S
            else:
                if relay not in self.due:
                    log.info("relay slot held", extra={"relay": relay, "expire": got.expire})
                self.failed.pop(relay, None)
                self.due[relay] = self.clock() + RENEW_S
        return self.held() != before

    def next_due(self) -> float:
        times = [*self.due.values(), *self.failed.values()]
        return max(0.0, min(times) - self.clock()) if times else RENEW_S

    async def first(self, timeout: float) -> None:
        """Hold a slot on at least one relay within ``timeout`` seconds, or say what to change."""
        deadline = self.clock() + timeout
        while not await self.renew() and not self.held():
            if self.clock() + RETRY_S > deadline:
                raise TimeoutError(
                    f"no relay gave this peer a slot within {timeout:g} s ({', '.join(self.relays) or 'none given'}):"
                    " give --relay-via a public peer started with --relay, or forward a port and start with"
                    " --reachability public --announce-maddr"
                )
            await asyncio.sleep(RETRY_S)

    async def run(self, stop: asyncio.Event, on_change: Callable[[list[str]], None], peer_id: str) -> None:
        """Keep the slots until ``stop``; ``on_change`` gets the peer's relayed addresses when the set changes."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.next_due())
                return
            except TimeoutError:
                pass
            if await self.renew():
                on_change(self.maddrs(peer_id))
