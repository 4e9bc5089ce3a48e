"""Forward passes kept for a pending backward, so a training step costs one forward and one backward on the server
rather than two forwards (recompute).

A kept graph holds every tensor autograd saved, which for a long sequence is far more than its input; so the store
is bounded in bytes (what the forward saved, measured as it ran), per caller and in total, and in age. A caller over
its share loses its own oldest graphs first; a graph that would overflow the total is not kept at all. Either way
the backward that finds its entry gone gets ``ActivationsGoneError`` and the client resends the inputs for a
recompute: a bound costs a training client speed, never correctness, and no caller can evict another's graphs."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from peers.serving.adapters import Adapter, Pin
from swarm.ids import Span


@dataclass
class Kept:
    inputs: torch.Tensor  # requires_grad leaf fed to the span
    outputs: torch.Tensor  # the span's output, still attached to the graph
    sub: Span
    nbytes: int = 0  # what the forward saved for backward (see ``SavedBytes``)
    adapter: Adapter | None = None  # the request's adapter leaves, whose gradients backward returns
    pin: Pin | None = None  # holds the adapter's cache entry (and its bytes in the adapter budget) while kept
    caller: str = ""
    created: float = 0.0

    def drop(self) -> None:
        if self.pin is not None:
            self.pin.release()


class SavedBytes:
    """Bytes of the tensors autograd saves while this is active, each storage counted once, and none of the
    storages in ``exclude`` (the weights and the adapter's cached tensors, which exist whether the graph is kept or
    not)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: set[int] = set()
        self.nbytes = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.nbytes += storage.nbytes()

    @contextmanager
    def measuring(self) -> Iterator[SavedBytes]:
        """While active, autograd saves through ``_pack``: the tensors it saves are counted (and kept as usual)."""

        def pack(t: torch.Tensor) -> _Saved:
            self.add(t)
            return _pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield self


# What a saved-tensors hook keeps of a tensor: a detached alias and its version. Not the tensor itself: an op that
# saves its own output (tanh, exp, softmax, ...) would then hold, through that tensor's ``grad_fn``, the node that
# holds it, a reference cycle that kept every dropped graph alive until a full garbage collection. The alias shares
# the storage and the version counter, so ``_unpack`` still sees an in-place change (an optimizer step on the
# weights since the forward), which autograd checks only for tensors it saves itself, not through hooks.
_Saved = tuple[torch.Tensor, int]
INPLACE = "one of the tensors saved for backward has been modified by an inplace operation since the forward"


def _pack(t: torch.Tensor) -> _Saved:
    return t.detach(), t._version


def _unpack(saved: _Saved) -> torch.Tensor:
    tensor, version = saved
    if tensor._version != version:
        raise RuntimeError(INPLACE)  # the wording ``PassService._backward`` recognises, as autograd's own
    return tensor


def storages(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class ActivationStore:
    def __init__(
        self, max_bytes: int, max_bytes_per_caller: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.per_caller = min(max_bytes_per_caller, max_bytes)
        self.ttl = ttl
        self.clock = clock
        self._items: OrderedDict[tuple[str, str], Kept] = OrderedDict()  # by (caller, forward id), oldest first
        self._bytes: Counter[str] = Counter()  # per caller

    @property
    def nbytes(self) -> int:
        return self._bytes.total()

    def bytes_of(self, caller: str) -> int:
        return self._bytes[caller]

    def put(self, caller: str, key: str, kept: Kept) -> bool:
        """Keep ``kept`` under the caller's own key (another caller that learns a forward id cannot take or replace
        the graph); False when it is not kept (its pin is then released)."""
        self._expire()
        self._remove((caller, key))
        kept.caller, kept.created = caller, self.clock()
        if kept.nbytes > self.per_caller:
            kept.drop()
            return False
        for k in [k for k in self._items if k[0] == caller]:  # this caller's oldest go first, nobody else's
            if self._bytes[caller] + kept.nbytes <= self.per_caller:
                break
            self._remove(k)
        if self.nbytes + kept.nbytes > self.max_bytes:  # full of other callers' graphs: recompute instead
            kept.drop()
            return False
        self._items[(caller, key)] = kept
        self._bytes[caller] += kept.nbytes
        return True

    def pop(self, caller: str, key: str) -> Kept | None:
        """The graph, now the backward's: its pin is released (the backward holds the tensors it needs)."""
        self._expire()
        kept = self._items.pop((caller, key), None)
        if kept is not None:
            self._account(kept)
            kept.drop()
        return kept

    def __len__(self) -> int:
        return len(self._items)

    def _remove(self, key: tuple[str, str]) -> None:
        kept = self._items.pop(key, None)
        if kept is not None:
            self._account(kept)
            kept.drop()

    def _account(self, kept: Kept) -> None:
        self._bytes[kept.caller] -= kept.nbytes
        if self._bytes[kept.caller] <= 0:
            del self._bytes[kept.caller]

    def expire(self) -> None:
        """Drop what outlived the ttl (also done on every put and pop; ``peers.run`` calls it periodically, so a
        caller who never comes back holds nothing past the ttl)."""
        self._expire()

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        while self._items and next(iter(self._items.values())).created < deadline:
            self._remove(next(iter(self._items)))
