"""The one failure path: every remote operation (forward hop, backward hop with its recompute, inference step, a
route that waits for blocks, a notice that fails) goes through this helper.

An attempt that fails with a retriable error bans the peer that failed (for a time that doubles with each failure of
that peer), backs off briefly, and runs again; the attempt itself re-routes around banned peers. Blocks that nobody
serves are waited for (the view is re-read each time) for at most ``missing_blocks_wait`` before the
``MissingBlocksError`` reaches the caller. Non-retriable errors (bad input) and errors past the total time budget
reach the caller unchanged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from swarm.config import Timing
from swarm.errors import MissingBlocksError, SwarmError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Bans(Protocol):
    """What the helper needs of the client's view of the swarm."""

    def ban(self, peer_id: str, seconds: float) -> None: ...

    def invalidate(self) -> None: ...


class Retrier:
    def __init__(
        self,
        view: Bans,
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
        missing_since: float | None = None
        delay = self.timing.backoff_min
        while True:
            try:
                return attempt()
            except MissingBlocksError:
                now = self.clock()
                missing_since = now if missing_since is None else missing_since
                left = missing_since + self.timing.missing_blocks_wait - now
                if left <= 0:
                    raise
                self.view.invalidate()
                self.sleep(min(self.timing.view_refresh, left))
            except SwarmError as e:
                if not e.retriable or self.clock() > deadline:
                    raise
                self.note_failure(e, what)
                self.sleep(delay)
                delay = min(delay * 2, self.timing.backoff_max)

    def note_failure(self, e: SwarmError, what: str = "call") -> None:
        """Ban the peer behind a retriable failure (for a time doubling with each of its failures) and count it."""
        peer = e.peer_id
        if peer is not None:
            n = self.failures[peer] = self.failures.get(peer, 0) + 1
            self.view.ban(peer, self.timing.ban_base * 2 ** (n - 1))
        self.failovers += 1
        log.warning("%s failed, failing over: %s", what, e, extra={"peer": peer})
