"""Clients' adapters on a server: validated, cached per client by content version, and bound to one request.

Base weights are never touched: a request's adapter is applied by the backend's hooks for that request only. The
cache lets a training client send its adapter once per optimizer step and an inference session once per hop; it is
keyed by the client's random token, bounded in bytes (least recently used client goes first) and in idle time."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.errors import AdapterMissingError, BadInputError
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
    linears: dict[str, tuple[int, int]],
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


@dataclass
class _Entry:
    version: int
    scaling: float
    blocks: dict[int, Adapter]  # per block, so hops over different parts of this server's span share the cache
    used: float
    nbytes: int = 0


class AdapterCache:
    def __init__(self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ref: AdapterRef, adapter: Adapter, sub: Span) -> None:
        self._expire()
        entry = self._entries.pop(ref.client, None)
        if entry is None or entry.version != ref.version:  # a new version replaces every block of the old one
            entry = _Entry(ref.version, adapter.scaling, {}, self.clock())
        for block in sub:
            part = Adapter(
                adapter.scaling,
                {k: v for k, v in adapter.lora.items() if k[0] == block},
                {k: v for k, v in adapter.deep.items() if k == block},
            )
            old = entry.blocks.get(block)
            entry.nbytes += _bytes(part) - (_bytes(old) if old is not None else 0)
            entry.blocks[block] = part
        entry.used = self.clock()
        self._entries[ref.client] = entry
        while self.nbytes > self.max_bytes and len(self._entries) > 1:
            self._entries.popitem(last=False)
        if self.nbytes > self.max_bytes:
            self._entries.clear()
            raise BadInputError(f"adapter larger than this server's adapter cache ({self.max_bytes} bytes)")

    def get(self, ref: AdapterRef, sub: Span) -> Adapter:
        self._expire()
        entry = self._entries.get(ref.client)
        if entry is None or entry.version != ref.version or any(b not in entry.blocks for b in sub):
            raise AdapterMissingError(f"no cached adapter version {ref.version} for blocks {sub}; send its tensors")
        self._entries.move_to_end(ref.client)
        entry.used = self.clock()
        merged = Adapter(entry.scaling)
        for block in sub:
            merged.lora.update(entry.blocks[block].lora)
            merged.deep.update(entry.blocks[block].deep)
        return merged

    def drop(self, client: str) -> None:
        self._entries.pop(client, None)

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        for client in [c for c, e in self._entries.items() if e.used < deadline]:
            del self._entries[client]


def _bytes(adapter: Adapter) -> int:
    return sum(t.numel() * t.element_size() for t in adapter.named().values())
