"""Names shared by every party: block spans and DHT keys."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from swarm.errors import BadInputError


@dataclass(frozen=True, order=True)
class Span:
    """Blocks ``start`` (inclusive) to ``end`` (exclusive)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise BadInputError(f"invalid block span {self.start}:{self.end}")

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __contains__(self, other: object) -> bool:
        if isinstance(other, Span):
            return self.start <= other.start and other.end <= self.end
        return isinstance(other, int) and self.start <= other < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def parse_span(text: str) -> Span:
    """``"0:8"`` -> Span(0, 8)."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise BadInputError(f"a span looks like START:END (e.g. 0:8), got {text!r}") from None
    return Span(start, end)


def block_key(model_id: str, block: int) -> str:
    """DHT key of one block (namespaced by model so several models share one swarm). Server records were stored
    under each block's key before schema 3; they go under ``servers_key`` now."""
    return f"swarm/{model_id}/block/{block}"


# A server's record is stored once, in one of SHARDS keys chosen by its peer id: a key then holds about N / SHARDS
# records, a store or a read moves one key's, and a client that needs only some of the servers to route reads a few
# shards (``swarm.dht.RecordStore.view``). Few keys: each key read or written costs a lookup of its replicas.
SHARDS = 16


def shard_of(peer_id: str) -> int:
    """The shard a peer's server records go to (stable across processes: not Python's salted hash)."""
    return hashlib.sha256(peer_id.encode()).digest()[0] % SHARDS


def servers_key(model_id: str, shard: int) -> str:
    """DHT key of the server records of peers of ``shard`` (each in its own signed subkey)."""
    return f"swarm/{model_id}/servers/{shard}"


def peers_key(model_id: str, shard: int) -> str:
    """The heartbeat records (hardware, state, span) of the peers of ``shard`` (``shard_of``), what the broker plans
    with: sharded as server records are, so no one key holds every peer's (one key of 10,000 heartbeats is past what
    one DHT message carries)."""
    return f"swarm/{model_id}/peers/{shard}"


def broker_key(model_id: str) -> str:
    """Broker leases, one subkey per candidate."""
    return f"swarm/{model_id}/broker"


def assignment_key(model_id: str) -> str:
    """The broker's assignments, one subkey per broker that issued one."""
    return f"swarm/{model_id}/assignment"
