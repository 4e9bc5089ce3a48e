"""Clients' adapters on a server: validated, cached per client by content version, and bound to one request.

Base weights are never touched: a request's adapter is applied by the backend's hooks for that request only. The
cache lets a training client send its adapter once per optimizer step and an inference session once per hop; it is
keyed by the caller's identity and the client's random token, bounded in bytes per caller and in total (adapters in
use are pinned and count; unpinned ones go least recently used first) and in idle time."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from swarm.errors import AdapterMissingError, BadInputError, BusyError
from swarm.ids import Span
from swarm.protocol import AdapterRef
from swarm.tuning import deep_name, is_adapter_name, lora_name, parse_name

MAX_RANK = 1024


@dataclass
class Adapter:
    """What one request applies: LoRA pairs by (block, module path), deep prompts by block, keyed by wire name."""

    scaling: float = 1.0
    lora: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    deep: dict[int, torch.Tensor] = field(default_factory=dict)

    def named(self) -> dict[str, torch.Tensor]:
        out = {deep_name(b): t for b, t in self.deep.items()}
        for (block, path), (a, b) in self.lora.items():
            out[lora_name(block, path, "A")], out[lora_name(block, path, "B")] = a, b
        return out

    def trainable(self) -> Adapter:
        """A copy whose tensors are fresh leaves that require grad (sharing storage), so a backward can return
        their gradients without touching the cached tensors."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(True)

        return Adapter(
            self.scaling,
            {k: (leaf(a), leaf(b)) for k, (a, b) in self.lora.items()},
            {k: leaf(t) for k, t in self.deep.items()},
        )

    @property
    def prompt_tokens(self) -> int:
        return next(iter(self.deep.values())).shape[0] if self.deep else 0


def parse_adapter(
    tensors: dict[str, torch.Tensor],
    sub: Span,
    linears: Mapping[str, tuple[int, int]],
    hidden_size: int,
    dtype: torch.dtype,
    scaling: float,
) -> Adapter:
    """Check every adapter tensor against the blocks it names (which must lie in ``sub``) and build an Adapter."""
    adapter = Adapter(scaling=float(scaling))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if not is_adapter_name(name):
            continue
        kind, block, path, which = parse_name(name)
        if block not in sub:
            raise BadInputError(f"adapter tensor {name!r} is for block {block}, outside the requested blocks {sub}")
        if t.dtype != dtype:
            raise BadInputError(f"adapter tensor {name!r} must be {dtype}, got {t.dtype}")
        if kind == "deep":
            if t.ndim != 2 or t.shape[1] != hidden_size or t.shape[0] == 0:
                raise BadInputError(f"deep prompt {name!r} must be [tokens, {hidden_size}], got {list(t.shape)}")
            adapter.deep[block] = t
            continue
        if path is None or which is None or path not in linears:
            raise BadInputError(f"adapter tensor {name!r}: blocks have no linear module {path!r}")
        pairs.setdefault((block, path), {})[which] = t
    for (block, path), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise BadInputError(f"LoRA pair for block {block} {path} lacks its {'B' if 'A' in pair else 'A'} matrix")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = linears[path]
        rank = a.shape[0] if a.ndim == 2 else -1
        if not (0 < rank <= MAX_RANK) or tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise BadInputError(
                f"LoRA pair for block {block} {path} must be A [rank, {fan_in}] and B [{fan_out}, rank] with "
                f"rank <= {MAX_RANK}, got A {list(a.shape)} and B {list(b.shape)}"
            )
        adapter.lora[(block, path)] = (a, b)
    sizes = {t.shape[0] for t in adapter.deep.values()}
    if len(sizes) > 1:
        raise BadInputError(f"deep prompts of one request differ in length: {sorted(sizes)}")
    return adapter


@dataclass(eq=False)
class _Entry:
    caller: str
    version: int
    scaling: float
    blocks: dict[int, Adapter]  # per block, so hops over different parts of this server's span share the cache
    used: float
    nbytes: int = 0
    pins: int = 0  # open sessions, running requests and kept graphs using this entry: not evictable meanwhile
    retired: bool = False  # replaced or dropped while pinned: no longer found, but its bytes still count


class Pin:
    """One holder's claim on a cache entry. While any pin is held the entry is not evicted, and its bytes count in
    the budget even after a newer version replaced it: the memory is in use either way."""

    def __init__(self, cache: AdapterCache, entry: _Entry) -> None:
        self._cache, self._entry = cache, entry
        self._held = True
        entry.pins += 1

    def release(self) -> None:
        if self._held:  # idempotent: a kept graph and its backward may both let go
            self._held = False
            self._entry.pins -= 1
            if self._entry.pins == 0 and self._entry.retired:
                self._cache._retired.remove(self._entry)


class AdapterCache:
    """Keyed by (caller, client token): the token travels to every server on a route, so a server that learns it
    must not be able to overwrite or release the client's adapter elsewhere; the caller's authenticated peer id is
    what it cannot forge. Bounded in bytes per caller and in total, and by idle time. An upload makes room by
    evicting unpinned entries, least recently used first, only as many as it needs; an upload that cannot fit is
    refused rather than evicting every other client."""

    def __init__(
        self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic, per_caller: int | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.per_caller = min(per_caller or max_bytes, max_bytes)
        self.ttl = ttl
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # least recently used first
        self._retired: list[_Entry] = []

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values()) + sum(e.nbytes for e in self._retired)

    def bytes_of(self, caller: str) -> int:
        return sum(e.nbytes for e in (*self._entries.values(), *self._retired) if e.caller == caller)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, caller: str, ref: AdapterRef, adapter: Adapter, sub: Span) -> tuple[Adapter, Pin]:
        """Cache the blocks ``sub`` of ``adapter``; returns it pinned (release the pin when done with it)."""
        self._expire()
        key = (caller, ref.client)
        old = self._entries.get(key)
        same = old is not None and old.version == ref.version  # a new version replaces every block of the old one
        blocks = dict(old.blocks) if old is not None and same else {}
        for block in sub:
            blocks[block] = Adapter(
                adapter.scaling,
                {k: v for k, v in adapter.lora.items() if k[0] == block},
                {k: v for k, v in adapter.deep.items() if k == block},
            )
        nbytes = sum(_bytes(part) for part in blocks.values())
        if nbytes > self.per_caller:
            raise BadInputError(
                f"adapter of {nbytes} bytes exceeds this server's room for one caller's adapters ({self.per_caller} "
                "bytes, --max-caller-adapter-mb)"
            )
        # what stops counting once this entry is in: the old one, unless a holder still uses it
        freed = old.nbytes if old is not None and (same or old.pins == 0) else 0
        victims = self._make_room(caller, key, nbytes, freed)
        for victim in victims:
            self._discard(victim)
        if old is not None and same:
            old.blocks, old.nbytes, old.scaling = blocks, nbytes, adapter.scaling
            entry = old
        else:
            if old is not None:
                self._discard(key)
            entry = _Entry(caller, ref.version, adapter.scaling, blocks, self.clock(), nbytes)
        entry.used = self.clock()
        self._entries[key] = entry
        self._entries.move_to_end(key)
        return self._merged(entry, sub), Pin(self, entry)

    def _make_room(self, caller: str, key: tuple[str, str], nbytes: int, freed: int) -> list[tuple[str, str]]:
        """The entries to evict so that ``nbytes`` more fit (``freed`` leaves as they come in), checked before
        anything is evicted: a refused upload costs nobody their adapter."""
        evictable = [k for k, e in self._entries.items() if e.pins == 0 and k != key]
        victims: list[tuple[str, str]] = []
        over = self.bytes_of(caller) - freed + nbytes - self.per_caller
        for k in evictable:  # this caller's own, least recently used first
            if over <= 0:
                break
            if k[0] == caller:
                victims.append(k)
                over -= self._entries[k].nbytes
        if over > 0:
            raise BusyError(
                f"this caller's adapters in use here (by its open sessions and kept forward passes) fill its room of "
                f"{self.per_caller} bytes (--max-caller-adapter-mb); end some or try again later"
            )
        over = self.nbytes - sum(self._entries[k].nbytes for k in victims) - freed + nbytes - self.max_bytes
        for k in evictable:  # then anyone's, least recently used first, only as many as needed
            if over <= 0:
                break
            if k not in victims:
                victims.append(k)
                over -= self._entries[k].nbytes
        if over > 0:
            raise BusyError(
                f"no adapter room: this server's {self.max_bytes} bytes (--max-adapter-mb) are held by adapters in "
                "use; try another server or again later"
            )
        return victims

    def get(self, caller: str, ref: AdapterRef, sub: Span) -> tuple[Adapter, Pin]:
        """The cached blocks ``sub`` of this caller's adapter, pinned (release the pin when done with it)."""
        self._expire()
        key = (caller, ref.client)
        entry = self._entries.get(key)
        if entry is None or entry.version != ref.version or any(b not in entry.blocks for b in sub):
            raise AdapterMissingError(f"no cached adapter version {ref.version} for blocks {sub}; send its tensors")
        self._entries.move_to_end(key)
        entry.used = self.clock()
        return self._merged(entry, sub), Pin(self, entry)

    def drop(self, caller: str, client: str) -> None:
        """The caller is done with this adapter (only its own: the key holds the caller's identity)."""
        self._discard((caller, client))

    @staticmethod
    def _merged(entry: _Entry, sub: Span) -> Adapter:
        merged = Adapter(entry.scaling)
        for block in sub:
            merged.lora.update(entry.blocks[block].lora)
            merged.deep.update(entry.blocks[block].deep)
        return merged

    def _discard(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.pins > 0:
            entry.retired = True
            self._retired.append(entry)

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        for key in [k for k, e in self._entries.items() if e.used < deadline and e.pins == 0]:
            del self._entries[key]


def _bytes(adapter: Adapter) -> int:
    return sum(t.numel() * t.element_size() for t in adapter.named().values())
