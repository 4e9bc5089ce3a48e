"""The retry helper bans failing peers with growing durations, waits a bounded time for missing blocks, and gives
up on bad input or after its budget."""

from __future__ import annotations

import pytest

from swarm.client.retry import Retrier
from swarm.config import Timing
from swarm.errors import BadInputError, MissingBlocksError, PeerUnavailableError, SwarmError


class FakeView:
    def __init__(self) -> None:
        self.bans: list[tuple[str, float]] = []
        self.invalidated = 0

    def ban(self, peer: str, seconds: float) -> None:
        self.bans.append((peer, seconds))

    def invalidate(self) -> None:
        self.invalidated += 1


def failing(peer: str, cls: type[SwarmError] = PeerUnavailableError) -> SwarmError:
    e = cls(f"{peer} failed")
    e.peer_id = peer
    return e


def make(budget: float = 10.0, missing_wait: float = 2.0) -> tuple[Retrier, FakeView, list[float]]:
    now = [0.0]
    view = FakeView()
    retrier = Retrier(
        view,
        Timing(retry_budget=budget, ban_base=2.0, missing_blocks_wait=missing_wait, view_refresh=0.5),
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    return retrier, view, now


def test_retries_and_bans_with_growing_duration():
    retrier, view, _ = make()
    errors = [failing("a"), failing("a"), failing("b")]

    def attempt() -> str:
        if errors:
            raise errors.pop(0)
        return "ok"

    assert retrier.run(attempt) == "ok"
    assert view.bans == [("a", 2.0), ("a", 4.0), ("b", 2.0)]
    assert retrier.failovers == 3


def test_bad_input_is_not_retried():
    retrier, view, _ = make()
    with pytest.raises(BadInputError):
        retrier.run(lambda: (_ for _ in ()).throw(failing("a", BadInputError)))
    assert view.bans == []


def test_gives_up_after_budget():
    retrier, _, now = make(budget=1.0)

    def attempt() -> None:
        now[0] += 0.4
        raise failing("a")

    with pytest.raises(PeerUnavailableError):
        retrier.run(attempt)


def test_missing_blocks_are_waited_for_with_fresh_views_then_reported():
    retrier, view, now = make(missing_wait=2.0)
    calls = [0]

    def attempt() -> str:
        calls[0] += 1
        if now[0] < 1.2:  # someone takes the blocks 1.2 s in
            raise MissingBlocksError([3], "m")
        return "routed"

    assert retrier.run(attempt) == "routed"
    assert view.invalidated == calls[0] - 1 and view.bans == [] and retrier.failovers == 0
    retrier, view, now = make(missing_wait=2.0)
    with pytest.raises(MissingBlocksError):
        retrier.run(lambda: (_ for _ in ()).throw(MissingBlocksError([3], "m")))
    assert 2.0 <= now[0] <= 2.0 + 1e-9
