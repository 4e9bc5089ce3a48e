"""Where an inference session's hops go: routes over servers with KV-cache room for the whole session, priced for
what most of a session is (decode steps, one token of each sequence), and a hop moved when it stays far slower than
its server announced. Peers the session moved away from are not chosen again for it while another route exists."""

from __future__ import annotations

import asyncio
import logging

from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState
from swarm.errors import CacheFullError, MissingBlocksError, SwarmError
from swarm.hop import Hop
from swarm.records import Capability

log = logging.getLogger(__name__)


class SessionRoutes:
    def __init__(
        self,
        conn: SwarmConnection,
        batch_size: int,
        max_length: int,
        needs: frozenset[Capability],
        session_id: str,
    ) -> None:
        self.conn, self.batch_size, self.max_length = conn, batch_size, max_length
        self.needs, self.session_id = needs, session_id
        self.avoid: set[str] = set()  # peers this session moved away from (slow, or leaving)
        self.slow_steps: dict[str, int] = {}  # hop (its session id) -> slow steps in a row

    def new(self, start: int, end: int, exclude: frozenset[str] = frozenset()) -> list[Hop]:
        """A route over blocks ``start:end`` whose servers have room for the session, priced by their load, none of
        them in ``exclude`` (servers that are leaving), each of its servers counted as holding one more of this
        client's sessions until ``release``; ``CacheFullError`` (not retried) when the blocks are served but none has
        the room."""
        route = self._route(start, end, exclude)
        self.conn.view.sessions_here.update(h.peer_id for h in route)
        return route

    def release(self, hops: list[Hop]) -> None:
        """The session left these hops (replaced, or closed): their servers count it no more."""
        here = self.conn.view.sessions_here
        here.subtract(h.peer_id for h in hops)
        for peer in [p for p, n in here.items() if n <= 0]:
            del here[peer]

    def _route(self, start: int, end: int, exclude: frozenset[str]) -> list[Hop]:
        need = self.batch_size * self.max_length
        view = self.conn.view
        if self.conn.trust is not None:  # servers convicted by others' accusations are banned before routing
            self.conn.trust.refresh()
        if self.avoid:  # a slow peer's claims may still price it first: try without it, then with it
            try:
                return view.route(
                    start,
                    end,
                    mode="inference",
                    min_cache_tokens=need,
                    needs=self.needs,
                    exclude=exclude | self.avoid,
                    tokens=self.batch_size,
                )
            except MissingBlocksError:
                pass
        try:
            return view.route(
                start,
                end,
                mode="inference",
                min_cache_tokens=need,
                needs=self.needs,
                exclude=exclude,
                tokens=self.batch_size,
            )
        except MissingBlocksError:
            # raises if the blocks themselves are missing
            view.route(start, end, mode="inference", needs=self.needs, exclude=exclude)
            error = CacheFullError(
                f"no server of blocks {start}:{end} has KV-cache room for a session of {need} tokens "
                f"(batch {self.batch_size} x max_length {self.max_length}); try a shorter max_length or later"
            )
            # a server of every block could hold it once room frees (or once a server that just started announces
            # its cache): try again, within the retry budget; longer than any server's whole cache: fail now
            snapshot = view.snapshot()
            error.retriable = all(
                any(r.cache_tokens_total >= need for r in snapshot.get(b, [])) for b in range(start, end)
            )
            raise error from None

    async def observe(self, state: HopState, elapsed: float, tokens: int) -> None:
        """Feed routing's latency estimates, and mark a hop broken (to be replaced) when it stays far slower than its
        server announced and another route is expected to be at least ``move_gain`` times as fast (no ban: a slow
        peer is still a working one)."""
        view, hop = self.conn.view, state.hop
        expected = hop.step_seconds * tokens + view.hop_latency  # what the server claimed
        view.observe(hop.peer_id, "inference", elapsed, tokens * len(hop.span))
        slow = elapsed > self.conn.timing.slow_factor * expected
        slow_steps = self.slow_steps.pop(state.session_id, 0) + 1 if slow else 0
        if 0 < slow_steps < self.conn.cfg.slow_steps:
            self.slow_steps[state.session_id] = slow_steps  # kept only while a hop is slow: a count per hop at most
        if slow_steps < self.conn.cfg.slow_steps:
            return
        try:
            other = await asyncio.to_thread(
                view.route,
                hop.start,
                hop.end,
                mode="inference",
                exclude=frozenset({hop.peer_id}),
                needs=self.needs,
                tokens=self.batch_size,
            )
        except SwarmError:
            return  # nowhere else to go
        estimate = sum(view.estimate(h, "inference", tokens) for h in other)
        if estimate < elapsed / self.conn.cfg.move_gain:
            log.warning("moving a slow hop", extra={"peer": hop.peer_id, "session": self.session_id})
            self.avoid.add(hop.peer_id)
            state.link.broken = True
