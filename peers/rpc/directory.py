"""Which peers serve this model with this server's weights, by their signed records: whom chaining trusts.

A client's route names the hops around a session, but a client is a stranger: it could name itself (another of its
identities) as the hop before, to push into its own session through a door the budget does not watch, or name as the
next hop an address of its choosing, to make this server dial anyone. So a hop takes pushes only from the peer the
route puts before it *and* that announces, in a record its own key signed, a span holding the block just before this
session's with the same weights (its fingerprint, or that of the same weights and dtype in another quantization
format: a client that allowed quantized blocks may route through both); and it pushes only to the next hop such a
record names, at the addresses that record announces (never those the route carries).

Records are read from the DHT by shard (a peer's record is in its shard's key, ``swarm.ids.shard_of``),
thoroughly (every replica's copy merged: a server that just joined or moved is found as soon as its record is stored
anywhere), and kept ``ttl`` seconds; a peer not found is looked up again at most once per ``ttl`` / 4 for its shard (a
flood of unknown names costs one DHT read a shard and period)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.ids import shard_of
from swarm.records import PeerState, ServerRecord


@dataclass
class _Shard:
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
        """``read``: the authentic server records of one shard (blocking: a DHT read, run off the loop);
        ``fingerprints``: the weights it chains with (its own, in the quantization formats clients may mix)."""
        self._read, self.fingerprints, self.num_blocks, self.ttl, self.clock = (
            read,
            fingerprints,
            num_blocks,
            ttl,
            clock,
        )
        self._shards: dict[int, _Shard] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def server_at(self, peer_id: str, block: int) -> ServerRecord | None:
        """The signed record of ``peer_id`` serving ``block`` with our weights, or None if it announces none."""
        return await self.server_in(peer_id, block, block + 1)

    async def server_in(self, peer_id: str, first: int, end: int) -> ServerRecord | None:
        """The signed record of ``peer_id`` serving any block of ``first:end`` with our weights, or None."""
        first, end = max(first, 0), min(end, self.num_blocks)
        if first >= end:
            return None
        shard = shard_of(peer_id)
        found = self._find(peer_id, shard, first, end)
        cached = self._shards.get(shard)
        if found is None and (cached is None or self.clock() - cached.fetched > self.ttl / 4):
            async with self._locks.setdefault(shard, asyncio.Lock()):  # callers at once share one read
                cached = self._shards.get(shard)
                if cached is None or self.clock() - cached.fetched > self.ttl / 4:
                    records = await asyncio.to_thread(self._read, shard)
                    self._shards[shard] = _Shard(self.clock(), {r.peer_id: r for r in records})
            found = self._find(peer_id, shard, first, end)
        return found

    def _find(self, peer_id: str, shard: int, first: int, end: int) -> ServerRecord | None:
        cached = self._shards.get(shard)
        if cached is None or self.clock() - cached.fetched > self.ttl:
            return None
        record = cached.records.get(peer_id)
        return record if record is not None and self._serves(record, first, end) else None

    def _serves(self, record: ServerRecord, first: int, end: int) -> bool:
        return (
            record.fingerprint in self.fingerprints
            and record.start < end
            and first < record.end
            and record.state in (PeerState.ONLINE, PeerState.LEAVING)
        )
