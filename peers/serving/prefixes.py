"""Prefix caching on a server: the KV cache of finished sessions' positions (and what the span answered at each),
kept within the KV budget and reused when a new session of the same caller starts with the same inputs, so a long
conversation's next turn, or a request behind a long system prompt, computes only what is new.

Servers never see token ids: a session's inputs are keyed by a chain of sha-256 digests of its span's input hidden
states, one every ``BLOCK`` positions (``digest k`` = sha-256 of digest k-1 and block k's bytes), computed by this
server from what it received. A new session's first step is looked up by the digests of its own input, so a reused
prefix is exactly the input that computed it: a digest forged to collide would have to collide sha-256, and a caller
who sends other inputs simply finds nothing. Even then, a few input rows of each block, at offsets this server drew
and never tells, are kept and compared before anything is reused. Only sessions that ask (``OpenSession.prefix``)
are kept or reused, only plain steps (default positions, no padding mask) count, and only caches of full-attention
layers written in place (``GrowingLayer``), without an adapter, on weights that do not learn.

A session's first step may also name a kept prefix instead of sending it (``swarm.rpc.claims``): a claim is looked
up by its chain's digest under the same scopes as any reuse (the sampled rows cannot be compared: none were sent),
so naming a chain gains only what sending the inputs it digests would.

Private by default: an entry is found only under the scope it was kept in, the authenticated caller's identity and
the namespace it gave (``swarm.api`` gives each API key its own), so nobody can probe by timing what another asked.
Sharing (a public system prompt) needs both sides: the server's ``--share-prefixes`` and the session's
``prefix.share``; shared entries are found by every sharing session. An entry counts in the KV budget under the
caller that computed it, within that caller's share (its own oldest entries leave first), and any new session's
room evicts the least recently used entries before it waits (``peers.serving.kv_cache.CacheBudget``). What an open
session keeps to be kept later (its trail: outputs, inputs to hash) is counted as it grows, never reserved ahead,
and given up (the session is then not kept) when a new session needs the room."""

from __future__ import annotations

import secrets
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from peers.serving.kv_cache import CacheBudget
from swarm.families.span import GrowingLayer
from swarm.ids import Span
from swarm.rpc.claims import BLOCK, block_digests

PICKS = 4  # input rows of each block kept beside its digest, at offsets only this server knows: checked on reuse
SHARED = ("", "shared")  # the scope of entries every sharing session finds
Scope = tuple[str, str]  # (caller's identity, its namespace), or SHARED


def eligible(cache: object | None) -> bool:
    """Whether a session's cache can be kept and copied: full-attention layers written in place, nothing else."""
    return type(cache) is DynamicCache and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


class Trail:
    """What a session that may be kept has seen: the digests of its inputs' whole blocks, the inputs since the block
    its last step began in (a step sent again from inside the last step is hashed again), and every position's
    output, and a few input rows of each block (``picks``: offsets in it). Any step that is not plain breaks it: the
    session is then neither kept nor a source of digests."""

    def __init__(
        self, limit: int | None = None, hold: Callable[[Trail, int], bool] | None = None, picks: Iterable[int] = (0,)
    ) -> None:
        self.limit = limit  # positions the session may hold: the outputs' room never grows past it
        # asked before the trail holds more bytes (``PrefixStore.hold``: counted in the KV budget as its caller's);
        # False (no room): the trail breaks instead, its session is simply not kept
        self.hold = hold
        self.nbytes = 0  # what it holds now, as counted
        self.digests: list[bytes] = []
        self.picks = torch.tensor(sorted(picks), dtype=torch.long)
        self.samples: list[torch.Tensor] = []  # [batch, picks, hidden] per whole block: its inputs at ``picks``
        self.rows: torch.Tensor | None = None  # inputs of positions [base, held)
        self.base = 0
        self.outputs: torch.Tensor | None = None  # [batch, room, hidden]: positions [0, held) are filled
        self.held = 0
        self.broken = False

    def ahead(self, position: int, hidden: torch.Tensor) -> Seen | None:
        """What the session would hold after a step at ``position`` of inputs ``hidden`` (None: the step begins
        before what can be hashed again, and the trail breaks)."""
        if self.broken or not self.base <= position <= self.held:
            self.broken = True
            return None
        rows = hidden if self.rows is None else torch.cat([self.rows[:, : position - self.base], hidden], dim=1)
        digests = self.digests[: position // BLOCK]  # blocks past the step's start are worked out again
        start = len(digests) * BLOCK  # digests cover [0, start), and base <= start: the rows hold all after it
        new = block_digests(digests[-1] if digests else b"", rows[:, start - self.base :])
        at = start - self.base
        picked = [rows[:, at + b * BLOCK + self.picks] for b in range(len(new))]
        return Seen(digests + new, self.samples[: len(digests)] + picked, rows)

    def adopt(self, entry: Entry, length: int) -> None:
        """A session that begins with ``entry``'s first ``length`` positions, claimed (``swarm.rpc.claims``): what
        it holds of them is the entry's (their digests, sampled inputs and outputs), the rest of its inputs follow."""
        outputs = entry.outputs[:, :length].clone()
        blocks = length // BLOCK
        row = outputs.shape[0] * outputs.shape[2] * outputs.element_size()
        if self.hold is not None and not self.hold(self, row * length + blocks * row * len(self.picks)):
            self.drop()
            return
        self.digests, self.samples = entry.digests[:blocks], entry.samples[:blocks]
        self.rows, self.base, self.outputs, self.held = None, length, outputs, length

    def record(self, position: int, out: torch.Tensor, seen: Seen) -> None:
        """A step at ``position`` answered ``out``; ``seen``: what ``ahead`` said of it."""
        if self.broken:  # its room was taken while the step ran
            return
        rows = seen.rows
        base = (position // BLOCK) * BLOCK  # a later step may begin back at ``position``: its block's rows stay
        kept = rows[:, base - self.base :]
        end = position + out.shape[1]
        buf = self.outputs
        room = buf.shape[1] if buf is not None else 0
        if end > room:
            room = max(end, 2 * room)
            room = min(room, max(end, self.limit)) if self.limit is not None else room
        row = out.shape[0] * out.shape[2] * out.element_size()
        picked = len(seen.samples) * row * len(self.picks)
        if self.hold is not None and not self.hold(self, row * room + kept.numel() * kept.element_size() + picked):
            self.drop()
            return
        if buf is None or end > buf.shape[1]:
            grown = out.new_empty((out.shape[0], room, out.shape[2]))
            if buf is not None:
                grown[:, : self.held] = buf[:, : self.held]
            buf = self.outputs = grown
        buf[:, position:end] = out
        self.digests, self.samples = seen.digests, seen.samples
        self.rows, self.base, self.held = kept.clone(), base, end

    def drop(self) -> None:
        """Break the trail and let go of what it holds (its room is needed, or its session cannot be kept)."""
        self.broken, self.rows, self.outputs, self.digests, self.samples = True, None, None, [], []
        if self.hold is not None and self.nbytes:
            self.hold(self, 0)


@dataclass(frozen=True)
class Seen:
    """What a trail would hold after a step: its blocks' digests and sampled inputs, and the rows from its base."""

    digests: list[bytes]
    samples: list[torch.Tensor]
    rows: torch.Tensor


@dataclass(eq=False)
class Entry:
    owner: str  # the caller charged for it (its scope and batch are in its ``keys``)
    sub: Span
    digests: list[bytes]  # one per whole block it holds
    samples: list[torch.Tensor]  # ...and its inputs at the store's ``picks`` in each
    cache: DynamicCache
    outputs: torch.Tensor  # [batch, length, hidden]
    nbytes: int
    weights: weakref.ref[object]  # the runtime it was computed by: an entry of other weights is never found
    keys: list[tuple[object, ...]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.digests) * BLOCK


@dataclass(frozen=True)
class Reuse:
    entry: Entry
    length: int  # positions reused


def copy_prefix(src: DynamicCache, dst: DynamicCache, start: int, end: int) -> None:
    """Append ``src``'s positions ``start:end`` to ``dst``, which holds ``start`` positions (of the same layers).
    In inference mode, as the steps that filled both ran: ``dst``'s room, made by an earlier step of its session on
    the compute thread, is an inference tensor, which takes no in-place write outside it."""
    with torch.inference_mode():
        for have, into in zip(src.layers, dst.layers, strict=True):
            if isinstance(have, GrowingLayer) and have.is_initialized and isinstance(into, GrowingLayer):
                assert have.keys is not None and have.values is not None
                into.update(have.keys[..., start:end, :].clone(), have.values[..., start:end, :].clone())


def crop_to(cache: DynamicCache, length: int) -> None:
    """Forget every position of ``cache`` from ``length`` on."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.is_initialized:
            layer.crop(min(0, length - layer.get_seq_length()))


class PrefixStore:
    """The kept prefixes of one server, least recently used first, charged to ``budget``. ``cost(sub, batch,
    length)``: the bytes an entry of ``length`` positions takes (its KV cache and its outputs)."""

    def __init__(self, budget: CacheBudget, cost: Callable[[Span, int, int], int], share: bool = False) -> None:
        self.budget, self.cost, self.share = budget, cost, share
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by id, least recently used first
        self.index: dict[tuple[object, ...], tuple[Entry, int]] = {}  # (scope, span, batch, digest) -> (entry, blocks)
        self.kept = 0  # bytes of the kept entries
        self.owned: Counter[str] = Counter()  # ...by owner
        self.picks = tuple(sorted(secrets.SystemRandom().sample(range(BLOCK), PICKS)))  # offsets checked on reuse
        self.collisions = 0  # digests that matched other inputs
        self.trails: dict[int, tuple[Trail, str]] = {}  # open sessions' trails that hold bytes, with their caller
        self.trail_bytes = 0
        budget.spare = self

    @property
    def nbytes(self) -> int:
        """All this store holds in the budget and gives back on demand: kept entries and open sessions' trails."""
        return self.kept + self.trail_bytes

    # ---- lookup ---------------------------------------------------------------------------------------------------
    def find(
        self, scopes: Iterable[Scope], sub: Span, batch: int, seen: Seen, after: int, weights: object
    ) -> Reuse | None:
        """The kept prefix under any of ``scopes``, computed by ``weights``, that holds the most of the inputs
        ``seen`` has the block digests of, if it holds more than their first ``after`` positions. A digest that
        matches with other inputs at the sampled offsets (a collision, found or forged) is never reused."""
        digests = seen.digests
        for k in range(len(digests), after // BLOCK, -1):
            for scope in scopes:
                hit = self.index.get((scope, sub.start, sub.end, batch, digests[k - 1]))
                if hit is None:
                    continue
                entry, blocks = hit
                if entry.weights() is not weights:  # other weights (a reload): never again
                    self._drop(entry)
                    continue
                if blocks == k and k * BLOCK > after:
                    if not all(torch.equal(a, b) for a, b in zip(entry.samples[:k], seen.samples[:k], strict=True)):
                        self.collisions += 1
                        continue
                    self.entries.move_to_end(id(entry))
                    return Reuse(entry, k * BLOCK)
        return None

    def claimed(
        self, scopes: Iterable[Scope], sub: Span, batch: int, chain: bytes, length: int, weights: object
    ) -> Entry | None:
        """The kept prefix under any of ``scopes``, computed by ``weights``, whose chain of block digests is
        ``chain`` at ``length`` positions (a whole number of blocks): what a claim names."""
        if length % BLOCK:
            return None
        for scope in scopes:
            hit = self.index.get((scope, sub.start, sub.end, batch, chain))
            if hit is None or hit[1] * BLOCK != length:
                continue
            if hit[0].weights() is not weights:
                self._drop(hit[0])
                continue
            self.entries.move_to_end(id(hit[0]))
            return hit[0]
        return None

    # ---- keeping --------------------------------------------------------------------------------------------------
    def trail(self, owner: str, limit: int) -> Trail:
        """A new trail for a session of ``owner`` that may hold ``limit`` positions."""
        return Trail(limit, self.hold(owner), self.picks)

    def hold(self, owner: str) -> Callable[[Trail, int], bool]:
        """What a trail of ``owner``'s session asks before it holds ``nbytes`` in all: room is made as for a kept
        entry (the owner's oldest entries over its share, then the least recently used), never by breaking
        another open session's trail; False when there is none."""

        def ask(trail: Trail, nbytes: int) -> bool:
            grow = nbytes - trail.nbytes
            if grow > 0 and not self._room_for(owner, grow, trails=False):
                return False
            self.budget.charge(grow, owner) if grow >= 0 else self.budget.discharge(-grow, owner)
            self.trail_bytes += grow
            trail.nbytes = nbytes
            if nbytes:
                self.trails[id(trail)] = (trail, owner)
            else:
                self.trails.pop(id(trail), None)
            return True

        return ask

    def keep(
        self, scope: Scope, owner: str, sub: Span, trail: Trail, cache: DynamicCache, weights: object
    ) -> Entry | None:
        """Keep a finished session's whole blocks (None: nothing to keep, or no room for it). The trail lets go
        of its own bytes either way (the entry is counted by itself)."""
        try:
            return self._keep(scope, owner, sub, trail, cache, weights)
        finally:
            trail.drop()

    def _keep(
        self, scope: Scope, owner: str, sub: Span, trail: Trail, cache: DynamicCache, weights: object
    ) -> Entry | None:
        blocks = min(len(trail.digests), trail.held // BLOCK)
        if trail.broken or not blocks or trail.outputs is None:
            return None
        length = blocks * BLOCK
        batch = trail.outputs.shape[0]
        digests = trail.digests[:blocks]
        last = self.index.get((scope, sub.start, sub.end, batch, digests[-1]))
        if last is not None and last[1] == blocks and last[0].weights() is weights:  # already kept (or within one)
            self.entries.move_to_end(id(last[0]))
            return None
        for k in range(blocks - 1, 0, -1):  # an entry this one extends is now within it: it goes
            hit = self.index.get((scope, sub.start, sub.end, batch, digests[k - 1]))
            if hit is not None and hit[0].length == k * BLOCK:
                self._drop(hit[0])
        nbytes = self.cost(sub, batch, length)
        outputs, samples = trail.outputs[:, :length], trail.samples[:blocks]
        trail.outputs = None
        trail.drop()  # its bytes are given back first: the entry takes (less than) their place
        if not self._room_for(owner, nbytes):
            return None
        crop_to(cache, length)
        try:
            ref: weakref.ref[object] = weakref.ref(weights)
        except TypeError:
            return None
        entry = Entry(owner, sub, digests, samples, cache, outputs.clone(), nbytes, ref)
        self.budget.charge(nbytes, owner)
        self.kept += nbytes
        self.owned[owner] += nbytes
        self.entries[id(entry)] = entry
        for k, d in enumerate(digests, 1):
            key = (scope, sub.start, sub.end, batch, d)
            entry.keys.append(key)
            self.index[key] = (entry, k)
        return entry

    def _room_for(self, owner: str, nbytes: int, trails: bool = True) -> bool:
        """Room for ``nbytes`` more of ``owner``'s: a kept entry (``trails``: open sessions' trails may break for it),
        or a trail's growth (``trails`` False), beside which the owner's kept entries stand, outside its share, until
        its session settles (``settle``): the session may be reusing them piece by piece."""
        budget = self.budget
        if nbytes > budget.per_caller or nbytes > budget.total:
            return False
        aside = 0 if trails else self.owned[owner]
        self.evict(max(0, budget.held[owner] - aside + nbytes - budget.per_caller), owner, trails, entries=trails)
        self.evict(max(0, nbytes - budget.free), None, trails)
        return budget.held[owner] - aside + nbytes <= budget.per_caller and budget.free >= nbytes

    # ---- giving room back -----------------------------------------------------------------------------------------
    def kept_by(self, owner: str) -> int:
        """Bytes of ``owner``'s kept entries."""
        return self.owned[owner]

    def settle(self, owner: str) -> None:
        """``owner``'s kept entries and trails back within its share, least recently used first: what its sessions'
        openings and trails let stand (``CacheBudget.reserve``, ``_room_for``) while they may reuse them, until a
        step that reused nothing."""
        budget = self.budget
        if budget.per_caller < budget.total:
            self.evict(budget.held[owner] - budget.per_caller, owner)

    def evict(self, nbytes: int, owner: str | None = None, trails: bool = True, entries: bool = True) -> None:
        """Drop least recently used entries (``owner``'s only, if given; ``entries``=False: none) until ``nbytes``
        are given back; then, if that is not enough, break open sessions' trails (those sessions will not be kept;
        ``trails``=False: not)."""
        for entry in list(self.entries.values()) if entries else ():
            if nbytes <= 0:
                return
            if owner is None or entry.owner == owner:
                nbytes -= entry.nbytes
                self._drop(entry)
        for trail, who in list(self.trails.values()) if trails else ():
            if nbytes <= 0:
                return
            if owner is None or who == owner:
                nbytes -= trail.nbytes
                trail.drop()

    def purge(self, held: Span | None) -> None:
        """Drop entries of blocks this server no longer holds (the broker moved it)."""
        for entry in list(self.entries.values()):
            if held is None or entry.sub not in held:
                self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        if self.entries.pop(id(entry), None) is None:
            return
        for key in entry.keys:
            if self.index.get(key, (None, 0))[0] is entry:
                del self.index[key]
        self.kept -= entry.nbytes
        self.owned[entry.owner] -= entry.nbytes
        self.budget.discharge(entry.nbytes, entry.owner)
