"""One step of an inference session as a value, and the chunks a long step is cut into."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    """One step through the session's hops: ``hidden`` [batch, n, hidden] (client dtype) at session position
    ``position``; ``mask`` over every position so far (None: no padding); ``positions`` as the caller gave them
    (None: the server infers them) and ``explicit``, the step's positions always (replays need them)."""

    hidden: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    explicit: torch.Tensor
    position: int

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def plain(self) -> bool:
        """At the default positions, without padding: what servers keep of a session, and claims name."""
        default = self.positions is None or torch.equal(
            self.positions.to(torch.int64),
            torch.arange(self.position, self.position + self.tokens).expand_as(self.positions),
        )
        return default and (self.mask is None or bool((self.mask == 1).all()))

    def entering(self, hidden: torch.Tensor) -> Step:
        """The same step, entering a later hop with that hop's input."""
        return Step(hidden, self.mask, self.positions, self.explicit, self.position)


@dataclass(frozen=True)
class Chunk:
    """One piece of a step: its positions ``start:end`` (the step's ``position`` added: those in the session)."""

    start: int
    end: int


def chunks(n: int, size: int) -> list[Chunk]:
    """A step of ``n`` tokens cut into pieces of at most ``size`` (``size`` <= 0: one piece)."""
    if size <= 0 or n <= size:
        return [Chunk(0, n)]
    return [Chunk(s, min(s + size, n)) for s in range(0, n, size)]
