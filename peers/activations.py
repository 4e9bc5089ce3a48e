"""Forward passes kept for a pending backward, so a training step costs one forward and one backward on the server
rather than two forwards (recompute). Bounded by count and age; a backward that finds its entry gone gets
``ActivationsGoneError`` and the client resends the inputs for a recompute."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peers.adapters import Adapter
from swarm.ids import Span


@dataclass
class Kept:
    inputs: torch.Tensor  # requires_grad leaf fed to the span
    outputs: torch.Tensor  # the span's output, still attached to the graph
    sub: Span
    created: float
    adapter: Adapter | None = None  # the request's adapter leaves, whose gradients backward returns


class ActivationStore:
    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.clock = clock
        self._items: OrderedDict[str, Kept] = OrderedDict()

    def put(
        self, key: str, inputs: torch.Tensor, outputs: torch.Tensor, sub: Span, adapter: Adapter | None = None
    ) -> None:
        self._expire()
        self._items[key] = Kept(inputs, outputs, sub, self.clock(), adapter)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def pop(self, key: str) -> Kept | None:
        self._expire()
        return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        while self._items and next(iter(self._items.values())).created < deadline:
            self._items.popitem(last=False)
