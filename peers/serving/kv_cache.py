"""KV-cache room under a budget in bytes: a session reserves what its family's caches take for its span, batch and
max_length when it opens (``KvCost``: grouped-query heads, hidden-sized caches, sliding windows and DeepSeek's
compressed latents each cost what they hold), waits a bounded time for room, and is refused with a clear error
rather than running the server out of memory. One caller may hold only its share of the budget, so a single
identity cannot take all of it (and an idle session gives its room back: see ``peers.rpc.servicer``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from transformers.cache_utils import LinearAttentionCacheLayerMixin

from swarm.errors import BusyError, CacheFullError
from swarm.families import kv
from swarm.families.spec import Family


@dataclass(frozen=True)
class KvCost:
    """What a session's caches cost on this peer, in bytes, and what a budget in bytes holds, in tokens."""

    family: Family
    dtype_bytes: int

    def session_bytes(self, start: int, end: int, batch: int, max_length: int) -> int:
        return kv.cache_bytes(self.family, range(start, end), max_length, self.dtype_bytes, batch)

    def tokens_within(self, start: int, end: int, budget: int) -> int:
        """Tokens of one sequence's context that ``budget`` bytes hold through blocks ``start:end``."""
        return kv.tokens_within(self.family, range(start, end), self.dtype_bytes, budget)

    def budget_for(self, tokens: int, blocks: int) -> int:
        """Bytes that hold ``tokens`` of context through the ``blocks`` costliest layers (a peer's budget before it
        knows its span: ``--cache-tokens`` then means at least that many tokens through any span it may serve)."""
        layers = range(int(self.family.config.num_hidden_layers))
        per_token = sorted((kv.elements_per_token(self.family, i) for i in layers), reverse=True)[:blocks]
        return sum(per_token) * tokens * self.dtype_bytes


class Spare(Protocol):
    """What holds budget it gives back on demand (``peers.serving.prefixes.PrefixStore``: kept prefixes)."""

    @property
    def nbytes(self) -> int: ...

    def evict(self, nbytes: int, owner: str | None = None, trails: bool = True, entries: bool = True) -> None: ...

    def kept_by(self, owner: str) -> int: ...


class CacheBudget:
    def __init__(self, total_bytes: int, per_caller: int | None = None) -> None:
        self.total = total_bytes
        self.per_caller = min(per_caller if per_caller is not None else total_bytes, total_bytes)
        self.used = 0
        self.held: Counter[str] = Counter()  # bytes reserved per caller
        self._changed = asyncio.Condition()
        self.spare: Spare | None = None  # kept prefixes: counted in ``used`` and ``held``, evicted for live sessions

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def available(self) -> int:
        """Room a new session can have without waiting: what is free and what kept prefixes would give back."""
        return self.free + (self.spare.nbytes if self.spare is not None else 0)

    def charge(self, nbytes: int, caller: str) -> None:
        """Count ``nbytes`` the caller's kept prefixes take (the caller of ``charge`` made sure they fit)."""
        self.used += nbytes
        self.held[caller] += nbytes

    def discharge(self, nbytes: int, caller: str) -> None:
        self.used -= nbytes
        self.held[caller] -= nbytes
        if self.held[caller] <= 0:
            del self.held[caller]

    async def reserve(self, nbytes: int, timeout: float, caller: str = "") -> int:
        if nbytes > self.total:
            raise CacheFullError(
                f"a session whose KV cache takes {_mb(nbytes)} (batch x max_length through this span) exceeds this "
                f"server's whole budget of {_mb(self.total)}"
            )
        # its own trails go first; its kept prefixes stand while the session may reuse them, counted in its share
        # again after its first step that reuses nothing (``PrefixStore.settle``)
        if self._over_share(caller, nbytes) and self.spare is not None:
            self.spare.evict(self._excess(caller, nbytes), caller, entries=False)
        if self._over_share(caller, nbytes):  # refused at once: only the caller's own sessions can free its share
            raise BusyError(
                f"a session of {_mb(nbytes)} of KV cache would take this caller past its share of this server's KV "
                f"cache: it holds {_mb(self.held[caller])} of {_mb(self.per_caller)} (--caller-cache-share)"
            )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.available >= nbytes), timeout)
            except TimeoutError:
                raise CacheFullError(
                    f"no KV-cache room: {_mb(nbytes)} wanted, {_mb(self.free)} of {_mb(self.total)} free after "
                    f"{timeout:.1f} s"
                ) from None
            # while this waited, the caller's other sessions may have taken its share, or their trails grown into it
            # (``peers.serving.prefixes``): what it keeps for later goes first, as above
            if self._over_share(caller, nbytes) and self.spare is not None:
                self.spare.evict(self._excess(caller, nbytes), caller, entries=False)
            if self._over_share(caller, nbytes):
                raise BusyError(f"this caller holds {_mb(self.held[caller])} of its {_mb(self.per_caller)} of KV cache")
            if self.free < nbytes and self.spare is not None:  # the least recently used kept prefixes make room
                self.spare.evict(nbytes - self.free)
            self.used += nbytes
            self.held[caller] += nbytes
        return nbytes

    def _excess(self, caller: str, nbytes: int) -> int:
        """How far a new session of ``nbytes`` takes the caller past its share, its kept prefixes aside."""
        kept = self.spare.kept_by(caller) if self.spare is not None else 0
        return self.held[caller] - kept + nbytes - self.per_caller

    def _over_share(self, caller: str, nbytes: int) -> bool:
        # a share of the whole budget is no share: then the caller waits for room like everyone
        return self.per_caller < self.total and self._excess(caller, nbytes) > 0

    async def release(self, nbytes: int, caller: str = "") -> None:
        async with self._changed:
            self.used -= nbytes
            self.held[caller] -= nbytes
            if self.held[caller] <= 0:
                del self.held[caller]
            self._changed.notify_all()


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def rewind(cache: object | None, drop: int) -> None:
    """Forget the last ``drop`` positions ``cache`` holds; with 0, sliding-window layers only give back what their
    window no longer needs (see ``swarm.families.span.new_cache``). Layers of blocks this span does not hold were
    never filled and are skipped (transformers' sliding layer cannot crop an empty layer). The ONNX runtime's cache
    is read up to the session's position whatever it holds beyond, so it has nothing to crop."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # convolution states: back to the kernel's width
            if any(layer.is_conv_states_initialized.values()):
                layer.crop(-drop)
        elif layer.is_initialized:
            layer.crop(-drop)


def recurrent(cache: object | None) -> bool:
    """Whether ``cache`` holds recurrent (state-space, linear-attention) states: a step folded into them is final."""
    return any(
        isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.is_recurrent_states_initialized.values())
        for layer in getattr(cache, "layers", ())
    )
