"""Which peers serve this model with this server's weights, by their signed records: whom chaining trusts.

A client's route names the hops around a session, but a client is a stranger: it could name itself (another of its
identities) as the hop before, to push into its own session through a door the budget does not watch, or name as the
next hop an address of its choosing, to make this server dial anyone. So a hop takes pushes only from the peer the
route puts before it *and* that announces, in a record its own key signed, a span holding the block just before this
session's with the same weights (its fingerprint, or that of the same weights and dtype in another quantization
format: a client that allowed quantized blocks may route through both); and it pushes only to the next hop such a
record names, at the addresses that record announces (never those the route carries).

Records are read from the DHT per block and kept ``ttl`` seconds; a peer not found is looked up again at most once
per ``ttl`` / 4 (a server that just joined is found, a flood of unknown names costs one DHT read a block)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.records import PeerState, ServerRecord


@dataclass
class _Block:
    fetched: float
    records: dict[str, ServerRecord] = field(default_factory=dict)


class ServerDirectory:
    def __init__(
        self,
        read: Callable[[int], list[ServerRecord]],
        fingerprints: frozenset[str],
        num_blocks: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``read``: the authentic server records under one block's key (blocking: a DHT read, run off the loop);
        ``fingerprints``: the weights it chains with (its own, in the quantization formats clients may mix)."""
        self._read, self.fingerprints, self.num_blocks, self.ttl, self.clock = (
            read,
            fingerprints,
            num_blocks,
            ttl,
            clock,
        )
        self._blocks: dict[int, _Block] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def server_at(self, peer_id: str, block: int) -> ServerRecord | None:
        """The signed record of ``peer_id`` serving ``block`` with our weights, or None if it announces none."""
        if not 0 <= block < self.num_blocks:
            return None
        found = self._find(peer_id, block)
        cached = self._blocks.get(block)
        if found is None and (cached is None or self.clock() - cached.fetched > self.ttl / 4):
            async with self._locks.setdefault(block, asyncio.Lock()):  # callers at once share one read
                cached = self._blocks.get(block)
                if cached is None or self.clock() - cached.fetched > self.ttl / 4:
                    records = await asyncio.to_thread(self._read, block)
                    self._blocks[block] = _Block(
                        self.clock(), {r.peer_id: r for r in records if self._serves(r, block)}
                    )
            found = self._find(peer_id, block)
        return found

    def _find(self, peer_id: str, block: int) -> ServerRecord | None:
        cached = self._blocks.get(block)
        if cached is None or self.clock() - cached.fetched > self.ttl:
            return None
        return cached.records.get(peer_id)

    def _serves(self, record: ServerRecord, block: int) -> bool:
        return (
            record.fingerprint in self.fingerprints
            and record.start <= block < record.end
            and record.state in (PeerState.ONLINE, PeerState.LEAVING)
        )
