"""The retry helper bans failing peers with growing durations, and gives up on bad input or after its budget."""

from __future__ import annotations

import pytest

from swarm.client.retry import Retrier
from swarm.config import Timing
from swarm.errors import BadInputError, PeerUnavailableError


class FakeView:
    def __init__(self):
        self.bans = []

    def ban(self, peer, seconds):
        self.bans.append((peer, seconds))


def failing(peer: str, cls=PeerUnavailableError):
    e = cls(f"{peer} failed")
    e.peer_id = peer
    return e


def make(budget=10.0):
    now = [0.0]
    view = FakeView()
    retrier = Retrier(
        view,
        Timing(retry_budget=budget, ban_base=2.0),
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    return retrier, view, now


def test_retries_and_bans_with_growing_duration():
    retrier, view, _ = make()
    errors = [failing("a"), failing("a"), failing("b")]

    def attempt():
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

    def attempt():
        now[0] += 0.4
        raise failing("a")

    with pytest.raises(PeerUnavailableError):
        retrier.run(attempt)
