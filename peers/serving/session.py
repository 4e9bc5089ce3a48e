"""One inference session on a server: its span, cache, caller and position, its route when chained, and what prefix
caching keeps of it (``peers.serving.sessions`` holds them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from peers.serving.adapters import Adapter, Pin
from peers.serving.prefixes import Trail
from swarm import wire
from swarm.ids import Span
from swarm.protocol import ChainRoute, PrefixUse
from swarm.records import ServerRecord


@dataclass(eq=False)
class Claimed:
    """A session's claimed first positions (``swarm.rpc.claims``): their outputs, and where the next piece starts."""

    length: int
    digest: str
    outputs: torch.Tensor
    next: int = 0


@dataclass
class Session:
    id: str
    sub: Span
    max_length: int
    batch: int
    cache: object | None  # the runtime's own KV cache (``SpanRuntime.new_cache``)
    reserved: int
    position: int = 0
    adapter: Adapter | None = None  # the client's adapter, bound for the session's life
    pin: Pin | None = None  # ...and held in the adapter cache (counted, not evictable) until the session ends
    caller: str = ""
    last_start: int | None = None  # where the last step began: a step sent again from there redoes it
    route: ChainRoute | None = None  # the client's signed route, once it gave one (``peers.rpc.chain``)
    index: int = 0  # this session's place in it
    next_hop: ServerRecord | None = None  # the signed record of the hop after it, which pushes are sent to
    room: wire.SessionRoom | None = None  # its room in the byte budget: its steps and pushes count there first
    prefix: PrefixUse | None = None  # prefix caching asked for (``peers.serving.prefixes``)...
    trail: Trail | None = None  # ...and what it has seen, while it can be kept
    reused: int = 0  # positions of its last step answered from a kept prefix
    claim: Claimed | None = None  # its first positions, claimed (``swarm.rpc.claims``), while their pieces come
    # steps waiting to run, from the client's stream and pushed by the previous hop, in arrival order
    inbox: asyncio.Queue[object] = field(default_factory=asyncio.Queue)

    @property
    def previous(self) -> str | None:
        """The peer id allowed to push into this session: the hop before it on the client's route."""
        return self.route.hops[self.index - 1].peer_id if self.route is not None and self.index > 0 else None
