"""The first blocks of the model, run on the client (``local_blocks=N``): what enters the swarm is then the output of
block N - 1, not the embeddings, which any server of block 0 could map straight back to the token ids.

The blocks are the family's own layers, loaded from the model folder (only their tensors are read) and run as a
server runs a span (``swarm.families.span``): the same masks, positions and rotary tables, so outputs equal a local
Hugging Face run. They run where the remote part of a plan starts (``PlanRunner``): on the hidden states after the
embeddings and any trainable prompts, and on a caller's ``inputs_embeds``. An inference session's steps go through
a KV cache of the client's own for these blocks, one per session, grown with its steps and rolled back when a step
fails before the servers took it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from swarm.errors import BadInputError, SessionLengthError
from swarm.families import span as family_span
from swarm.families import weights
from swarm.families.spec import Family

# a session's remote part: what runs the hidden states through the servers of the session's route
Remote = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Held:
    cache: DynamicCache
    length: int  # positions the cache holds


class LocalBlocks(torch.nn.Module):
    """Blocks ``0 .. count - 1`` of the model, frozen, on the client."""

    def __init__(self, family: Family, layers: list[torch.nn.Module], device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.family = family
        self.layers = torch.nn.ModuleList(layers)
        self.rotary = family.new_rotary(device)  # weightless: built, never loaded (None: learned positions, ALiBi)
        # one cache per open inference session (dropped with the session: no table of closed ones grows)
        self._caches: weakref.WeakKeyDictionary[object, _Held] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # sessions of several threads open and close at once

    @classmethod
    def load(cls, family: Family, folder: Path, count: int, dtype: torch.dtype) -> LocalBlocks:
        """The first ``count`` blocks from ``folder``: only their tensors are read."""
        if not 0 < count < family.num_layers:
            raise BadInputError(
                f"local_blocks={count}: give 1 to {family.num_layers - 1} (the swarm must serve at least the last "
                f"block; for the whole model, run it locally)"
            )
        return cls(family, weights.load_layers(family, folder, range(count), dtype, "cpu"))

    @property
    def count(self) -> int:
        return len(self.layers)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        past: int = 0,
    ) -> torch.Tensor:
        """The blocks over ``hidden`` [batch, n, hidden] (``past`` positions cached; ``attention_mask`` over all
        of them and the new ones, None: no padding), differentiable as any local module."""
        return family_span.run_span(
            self.family,
            list(self.layers),
            range(self.count),
            hidden,
            self.rotary,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            past=past,
        )

    def take_back(self, session: object, drop: int) -> None:
        """Forget the last ``drop`` positions of ``session``'s cache (a speculative step's rejected drafts), as the
        servers do at its next step."""
        held = self._caches.get(session)
        if held is None or drop <= 0:
            return
        if drop > held.length:
            raise SessionLengthError(f"cannot take back {drop} positions of {held.length}")
        held.cache.crop(-drop)
        held.length -= drop

    def step(
        self,
        session: object,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past: int,
        max_length: int,
        remote: Remote,
    ) -> torch.Tensor:
        """One step of ``session`` at position ``past``: the local blocks through its cache, then ``remote`` (the
        servers). If ``remote`` fails, the cache forgets this step's positions, so the step can be sent again."""
        with self._lock:
            held = self._caches.get(session)
            if held is None:
                held = self._caches[session] = _Held(family_span.new_cache(self.family, max_length), 0)
        if held.length != past:
            raise SessionLengthError(
                f"the local blocks hold {held.length} positions of this session, its step starts at {past}: "
                "start a new session"
            )
        n = hidden.shape[1]
        with torch.no_grad():
            out = self(hidden, attention_mask, position_ids, held.cache, past)
        held.length = past + n
        try:
            return remote(out)
        except BaseException:
            try:
                held.cache.crop(-n)  # the servers did not take this step: neither does the client's cache
                held.length = past
            except Exception:  # noqa: BLE001 - a cache that cannot roll back (a full sliding window): length stays
                pass  # ahead, and the next step says to start a new session
            raise
