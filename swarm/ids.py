"""Names shared by every party: block spans and DHT keys."""

from __future__ import annotations

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
    """DHT key of one block's server records; namespaced by model so several models share one swarm."""
    return f"swarm/{model_id}/block/{block}"


def peers_key(model_id: str) -> str:
    """Every peer's heartbeat record (hardware, state, span), what the broker plans with."""
    return f"swarm/{model_id}/peers"


def broker_key(model_id: str) -> str:
    """Broker leases, one subkey per candidate."""
    return f"swarm/{model_id}/broker"


def assignment_key(model_id: str) -> str:
    """The broker's assignments, one subkey per broker that issued one."""
    return f"swarm/{model_id}/assignment"
