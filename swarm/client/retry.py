"""The one retry helper: every remote operation (forward hop, backward hop, inference step) goes through it.

An attempt that fails with a retriable error bans the peer that failed (for a time that doubles with each failure of
that peer), backs off briefly, and runs again; the attempt itself re-routes around banned peers. Non-retriable
errors (bad input) and errors past the total time budget reach the caller unchanged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from swarm.client.swarm_view import SwarmView
from swarm.config import Timing
from swarm.errors import SwarmError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Retrier:
    def __init__(
        self,
        view: SwarmView,
        timing: Timing,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.view = view
        self.timing = timing
        self.clock = clock
        self.sleep = sleep
        self.failures: dict[str, int] = {}
        self.failovers = 0  # how many times a call moved on after a failure (exposed to users and tests)

    def run(self, attempt: Callable[[], T], what: str = "call") -> T:
        deadline = self.clock() + self.timing.retry_budget
        delay = 0.02
        while True:
            try:
                return attempt()
            except SwarmError as e:
                if not e.retriable or self.clock() > deadline:
                    raise
                self.note_failure(e, what)
                self.sleep(delay)
                delay = min(delay * 2, 1.0)

    def note_failure(self, e: SwarmError, what: str = "call") -> None:
        """Ban the peer behind a retriable failure (for a time doubling with each of its failures) and count it."""
        peer = getattr(e, "peer_id", None)
        if peer is not None:
            n = self.failures[peer] = self.failures.get(peer, 0) + 1
            self.view.ban(peer, self.timing.ban_base * 2 ** (n - 1))
        self.failovers += 1
        log.warning("%s failed, failing over: %s", what, e, extra={"peer": peer})
