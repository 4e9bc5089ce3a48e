"""The one failure path: every remote operation (forward hop, backward hop with its recompute, inference step, a
route that waits for blocks, a notice that fails) goes through this helper.

An attempt that fails with a retriable error bans the peer that failed (for a time that doubles with each failure of
that peer), backs off briefly, and runs again; the attempt itself re-routes around banned peers. Blocks that nobody
serves are waited for (the view is re-read each time) for at most ``missing_blocks_wait`` before the
``MissingBlocksError`` reaches the caller. Non-retriable errors and errors past the total time budget reach the
caller unchanged.

With ``confirm`` (a request the client built itself), a server's ``bad_input`` is a claim, not a verdict: one lying
or broken server must not end the user's call. Its server is set aside (banned for ``ban_base``) and the attempt
runs again elsewhere. If another server succeeds, the first was wrong: it stays banned like any failed peer. If
another also says bad input, or no other server holds those blocks, the error reaches the caller and the first is
cleared."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from swarm.config import Timing
from swarm.errors import (
    BadInputError,
    BusyError,
    MissingBlocksError,
    SessionExpiredError,
    SessionLengthError,
    SlowPeerError,
    SwarmError,
    UnknownHopError,
    UnseenHopError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_DOUBLINGS = 6  # a hop whose claims this client contradicted is set aside at most 2^6 x ban_base

# The declared errors a second server must confirm, by exact class. ``SessionLengthError`` too: the client refuses a
# step past max_length itself before sending it, so a server claiming one contradicts what the client knows. Not
# ``StaleStepError``: honest stages answer it whenever another trainer finished the step, and the trainer acts on it.
CONFIRMED: tuple[type[SwarmError], ...] = (BadInputError, SessionLengthError)


def suspicious(e: SwarmError) -> bool:
    """A server (not this side) declared the request bad: worth a second opinion."""
    return type(e) in CONFIRMED and e.declared and e.peer_id is not None


class Bans(Protocol):
    """What the helper needs of the client's view of the swarm."""

    def ban(self, peer_id: str, seconds: float) -> None: ...

    def unban(self, peer_id: str) -> None: ...

    def invalidate(self) -> None: ...

    def parole(self) -> frozenset[str]: ...

    def busy(self, peer_id: str, seconds: float) -> None: ...

    def listed(self, peer_id: str, block: int) -> bool: ...


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
        self.failures: dict[str, int] = {}  # peer -> failures counted against it (kept when its ban expires)
        self.banned_until: dict[str, float] = {}  # peer -> when the ban of its latest counted failure ends
        # peer -> the error of its latest counted failure: why it was banned, as a typed fact (its class, and a
        # ``PeerUnavailableError``'s ``cause``) for callers and tests, where the log says it in words
        self.last_failure: dict[str, SwarmError] = {}
        # peer -> how many times it said it saw no record of its next hop where this client's own read found one
        self.contradicted: dict[str, int] = {}
        self.failovers = 0  # how many times a call moved on after a failure (exposed to users and tests)

    def run(self, attempt: Callable[[], T], what: str = "call", confirm: bool = False) -> T:
        """``attempt()`` until it succeeds or fails for good; ``confirm``: a ``bad_input`` is checked on a second
        server before it reaches the caller."""
        deadline = self.clock() + self.timing.retry_budget
        missing_since: float | None = None
        delay = self.timing.backoff_min
        suspect: SwarmError | None = None  # a server's bad_input, awaiting a second server's opinion
        paroled = False  # peers banned for failing were tried again before blocks counted as missing
        while True:
            try:
                result = attempt()
            except MissingBlocksError:
                if suspect is not None:  # nobody else holds those blocks: the claim stands
                    raise self._acquit(suspect) from None
                now = self.clock()
                missing_since = now if missing_since is None else missing_since
                left = missing_since + self.timing.missing_blocks_wait - now
                if left <= 0 and not paroled:
                    # the blocks may be held by peers this client banned for failing (a saturated server's timeout,
                    # a step lost through a dead relay): before the call fails, they are tried once more
                    paroled = True
                    if lifted := self.view.parole():
                        for peer in lifted:  # tried again: a failure now bans it again
                            self.banned_until.pop(peer, None)
                        continue
                if left <= 0:
                    raise
                self.view.invalidate()
                self.sleep(min(self.timing.view_refresh, left))
                continue
            except SwarmError as e:
                # the attempt routed, so every block was served: blocks missing again later are a new wait (each
                # wait once paroled), not the rest of this one (two moves a minute apart, each leaving a block
                # unserved for a second, ended a call that had waited two seconds in all: stop 75's churn drill)
                missing_since, paroled = None, False
                if confirm and suspect is None and suspicious(e) and self.clock() <= deadline:
                    suspect = e
                    assert e.peer_id is not None
                    self.view.ban(e.peer_id, self.timing.ban_base)  # routes avoid it while another server judges
                    log.warning(
                        "%s refused as bad input, asking another server: %s", what, e, extra={"peer": e.peer_id}
                    )
                    continue
                if not e.retriable or self.clock() > deadline:
                    if suspect is not None:  # a second bad_input confirms the first; any other end clears it too
                        self._acquit(suspect)
                    raise
                self.note_failure(e, what)
                self.sleep(delay)
                delay = min(delay * 2, self.timing.backoff_max)
                continue
            if suspect is not None:  # another server took what the suspect refused: the suspect lied or is broken
                self.note_failure(suspect, what)
            return result

    def _acquit(self, suspect: SwarmError) -> SwarmError:
        """The suspect's claim was not contradicted: lift its ban; the claim is what the caller gets."""
        assert suspect.peer_id is not None
        self.view.unban(suspect.peer_id)
        self.banned_until.pop(suspect.peer_id, None)
        return suspect

    def note_failure(self, e: SwarmError, what: str = "call") -> None:
        """Ban the peer behind a retriable failure (for a time doubling with each of its failures) and count it. A
        session that idled out is no fault of the server's, and a server that missed a deadline but answered its
        liveness check is busy, not dead (``SlowPeerError``: set aside by routing, ``SwarmView.slow``), and a hop
        that does not see its neighbour's record yet (``UnknownHopError``: a server that just moved) is no one's
        fault: no ban. A server at one of its limits (``BusyError``: its open sessions, queue, or this caller's
        share of its cache) is busy too: set aside (``SwarmView.busy``), not banned, so calls go elsewhere where they
        can and come back to it with the backoff where it alone serves their blocks (banned, 16 streams of one API
        refused at once had banned it for 2^15 times the base within a second, and their calls failed as if its
        blocks were gone). A hop that says it sees no record of its next hop (``UnseenHopError``) gets the next hop
        banned only if this client's own read of that peer's shard finds no live record either; otherwise the hop
        that said so is set aside. Failures of a peer still banned for an earlier one (other sessions routed to it
        before the ban) count once."""
        peer = e.peer_id
        if isinstance(e, UnseenHopError) and peer is not None and self.view.listed(peer, e.block):
            # the hop before it sees no record of it where this client, reading the same shard now, does: the
            # reporter's reading lags (or it lies), not the next hop gone (banned, the only server of some blocks was
            # lost to the call for a neighbour's view: stop 75's churn drill). The reporter is set aside as a busy one
            # is, nobody banned; for longer each time (a liar would otherwise cost a failover every ban_base)
            n = self.contradicted[e.reporter] = self.contradicted.get(e.reporter, 0) + 1
            self.view.busy(e.reporter, self.timing.ban_base * 2 ** min(n - 1, MAX_DOUBLINGS))
            log.info(
                "this client finds the record its hop says is missing: the hop is set aside",
                extra={"peer": e.reporter, "next_hop": peer},
            )
        elif peer is not None and isinstance(e, BusyError):
            self.view.busy(peer, self.timing.ban_base)
        elif peer is not None and not isinstance(e, SessionExpiredError | SlowPeerError | UnknownHopError):
            self.last_failure[peer] = e
            if self.clock() >= self.banned_until.get(peer, -float("inf")):
                n = self.failures[peer] = self.failures.get(peer, 0) + 1
                seconds = self.timing.ban_base * 2 ** (n - 1)
                self.banned_until[peer] = self.clock() + seconds
                self.view.ban(peer, seconds)
        self.failovers += 1
        log.warning("%s failed, failing over: %s", what, e, extra={"peer": peer})
