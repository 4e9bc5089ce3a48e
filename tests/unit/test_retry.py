"""The retry helper bans failing peers with growing durations, waits a bounded time for missing blocks, gives up on
bad input or after its budget, and has a server's bad_input confirmed by a second server before believing it."""

from __future__ import annotations

import pytest

from swarm.client.retry import Retrier
from swarm.config import Timing
from swarm.errors import (
    BadInputError,
    MissingBlocksError,
    PeerUnavailableError,
    SessionLengthError,
    StaleStepError,
    SwarmError,
)
from swarm.protocol import ErrorReply


class FakeView:
    def __init__(self) -> None:
        self.bans: list[tuple[str, float]] = []
        self.busied: list[tuple[str, float]] = []
        self.banned: set[str] = set()
        self.for_cause: set[str] = set()
        self.invalidated = 0
        self.live: set[tuple[str, int]] = set()  # (peer, block): what a fresh read of the peer's shard finds

    def ban(self, peer: str, seconds: float) -> None:
        self.bans.append((peer, seconds))
        self.banned.add(peer)

    def unban(self, peer: str) -> None:
        self.banned.discard(peer)

    def invalidate(self) -> None:
        self.invalidated += 1

    def busy(self, peer: str, seconds: float) -> None:
        self.busied.append((peer, seconds))

    def listed(self, peer: str, block: int) -> bool:
        return (peer, block) in self.live

    def parole(self) -> frozenset[str]:
        lifted = frozenset(self.banned - self.for_cause)
        self.banned -= lifted
        return lifted


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
    retrier, view, now = make(budget=100.0)
    errors = [failing("a"), failing("a"), failing("b")]
    latest = {"a": errors[1], "b": errors[2]}

    def attempt() -> str:
        now[0] += 10.0  # each attempt after the last ban ended
        if errors:
            raise errors.pop(0)
        return "ok"

    assert retrier.run(attempt) == "ok"
    assert view.bans == [("a", 2.0), ("a", 4.0), ("b", 2.0)]
    assert retrier.failovers == 3
    assert retrier.failures == {"a": 2, "b": 1} and retrier.last_failure == latest  # the very errors, kept past bans


def test_failures_of_a_peer_already_banned_count_once_and_a_busy_one_is_set_aside_not_banned():
    """Sessions routed to a peer before its ban fail there too: one ban, not one doubling per session; and a server
    at one of its limits is busy, not dead."""
    from swarm.errors import BusyError

    retrier, view, now = make()
    for _ in range(16):
        retrier.note_failure(failing("a"))
    assert view.bans == [("a", 2.0)] and retrier.failures == {"a": 1}
    now[0] += 2.0  # the ban is over: the next failure doubles it
    retrier.note_failure(failing("a"))
    assert view.bans[-1] == ("a", 4.0)
    for _ in range(16):
        retrier.note_failure(failing("b", BusyError))
    assert ("b", 2.0) in view.busied and not [b for b in view.bans if b[0] == "b"] and "b" not in retrier.failures


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


def test_peers_banned_for_failing_are_tried_again_before_blocks_count_as_missing():
    """A saturated server's timeout bans it; if it alone holds blocks, the call tries it once more after the wait for
    missing blocks instead of failing with ``MissingBlocksError`` while it still serves them."""
    retrier, view, now = make(missing_wait=2.0)

    def attempt() -> str:
        if "a" in view.banned:  # "a" alone serves block 3: banned, it leaves block 3 without a server
            raise MissingBlocksError([3], "m")
        if not view.bans:
            raise failing("a")  # its first step timed out (busy, not dead)
        return "served by a"

    assert retrier.run(attempt) == "served by a"
    assert 2.0 <= now[0] <= 2.0 + view.bans[0][1]  # after the wait for missing blocks, not at once
    assert retrier.failures == {"a": 1}


def test_a_peer_banned_for_cause_is_never_paroled():
    retrier, view, now = make(missing_wait=2.0)
    view.ban("a", 3600.0)
    view.for_cause.add("a")  # caught computing wrong answers

    def attempt() -> str:
        if "a" in view.banned:
            raise MissingBlocksError([3], "m")
        return "served by a cheater"

    with pytest.raises(MissingBlocksError):
        retrier.run(attempt)
    assert "a" in view.banned and now[0] >= 2.0


# ---- a server's bad_input, confirmed elsewhere ------------------------------------------------------------------
def refusal(peer: str, code: str = "bad_input") -> SwarmError:
    """An error reply ``peer`` sent (declared), as the transport raises it."""
    return ErrorReply(code=code, error="hidden must be [batch, seq, 64]").exception(peer)


class Servers:
    """An attempt that routes to the first server the view has not banned, which answers with its scripted error
    (or "ok" from ``peer``)."""

    def __init__(self, view: FakeView, answers: dict[str, SwarmError | None]) -> None:
        self.view, self.answers, self.asked = view, answers, []

    def __call__(self) -> str:
        peer = next((p for p in self.answers if p not in self.view.banned), None)
        if peer is None:
            raise MissingBlocksError([0], "m")
        self.asked.append(peer)
        error = self.answers[peer]
        if error is not None:
            raise error
        return f"ok from {peer}"


def test_bad_input_contradicted_by_a_second_server_bans_the_first():
    retrier, view, now = make()
    servers = Servers(view, {"liar": refusal("liar"), "honest": None})
    assert retrier.run(servers, confirm=True) == "ok from honest"
    assert servers.asked == ["liar", "honest"]
    assert view.banned == {"liar"} and view.bans[-1] == ("liar", 2.0) and retrier.failures == {"liar": 1}
    assert retrier.failovers == 1 and now[0] == 0.0  # no backoff: another server was there at once


def test_bad_input_confirmed_by_a_second_server_reaches_the_user_and_clears_the_first():
    retrier, view, _ = make()
    second = refusal("b")
    servers = Servers(view, {"a": refusal("a"), "b": second, "c": None})
    with pytest.raises(BadInputError) as info:
        retrier.run(servers, confirm=True)
    assert info.value is second and servers.asked == ["a", "b"]  # two opinions, not three
    assert view.banned == set() and retrier.failovers == 0 and retrier.failures == {}


def test_bad_input_from_the_only_server_reaches_the_user_at_once():
    retrier, view, now = make(missing_wait=2.0)
    first = refusal("only")
    servers = Servers(view, {"only": first})
    with pytest.raises(BadInputError) as info:
        retrier.run(servers, confirm=True)
    assert info.value is first and now[0] == 0.0  # no wait for blocks: the claim stands
    assert view.banned == set() and view.invalidated == 0


def test_the_second_opinion_survives_other_failures_on_the_way():
    retrier, view, _ = make()
    servers = Servers(view, {"liar": refusal("liar"), "dead": failing("dead"), "honest": None})
    assert retrier.run(servers, confirm=True) == "ok from honest"
    assert view.banned == {"liar", "dead"} and retrier.failures == {"dead": 1, "liar": 1}


def test_without_confirm_or_for_legitimate_refusals_bad_input_is_final():
    retrier, view, _ = make()
    servers = Servers(view, {"a": refusal("a"), "b": None})
    with pytest.raises(BadInputError):
        retrier.run(servers)  # a request the client did not build: nothing to confirm
    stale = ErrorReply(code="stale_step", error="behind", server_step=3).exception("a")
    servers = Servers(view, {"a": stale, "b": None})
    with pytest.raises(StaleStepError):  # honest stages say so whenever another trainer finished the step
        retrier.run(servers, confirm=True)
    local = BadInputError("session is closed")  # raised on this side: no server to doubt
    with pytest.raises(BadInputError):
        retrier.run(lambda: (_ for _ in ()).throw(local), confirm=True)
    assert view.bans == []


def test_a_servers_session_length_claim_is_confirmed_too():
    retrier, view, _ = make()
    servers = Servers(view, {"liar": refusal("liar", "session_length"), "honest": None})
    assert retrier.run(servers, confirm=True) == "ok from honest"
    assert view.banned == {"liar"} and isinstance(refusal("x", "session_length"), SessionLengthError)


@pytest.mark.parametrize("timing", [Timing(), Timing.for_tests()], ids=["default", "tests"])
def test_budget_outlasts_one_hung_attempt(timing):
    """A hop that hangs costs an attempt its open and request timeouts; the budget must leave a failover after it
    (under the test timings too, or a hung replacement in a failure drill ends the user's call)."""
    now = [0.0]
    retrier = Retrier(FakeView(), timing, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    calls = []

    def attempt():
        calls.append(now[0])
        if len(calls) == 1:
            now[0] += timing.open_timeout + timing.request_timeout  # hung until both timeouts ran out
            raise failing("hung")
        return "ok"

    assert retrier.run(attempt) == "ok" and len(calls) == 2


def test_blocks_missing_twice_in_one_call_are_two_waits_not_one():
    """Blocks unserved for a moment, then routed (the attempt failed elsewhere), then unserved again later in the same
    call: each gap gets its own wait (one wait over both ended a call whose blocks were missing 2 s in all, while a
    broker moved peers: stop 75's churn drill)."""
    retrier, view, now = make(budget=100.0, missing_wait=2.0)
    script = iter(["missing"] * 3 + ["fail"] + ["missing"] * 3 + ["ok"])  # 1.5 s missing, a failure, 1.5 s missing

    def attempt() -> str:
        step = next(script)
        if step == "missing":
            raise MissingBlocksError([3], "m")
        if step == "fail":
            raise failing("a")
        return "routed"

    assert retrier.run(attempt) == "routed"
    assert retrier.failures == {"a": 1}


def test_a_hop_denying_its_next_hop_gets_it_banned_only_if_this_client_cannot_find_it_either():
    from swarm.errors import UnseenHopError

    def unseen() -> UnseenHopError:
        e = UnseenHopError("r sees no record of the next hop n", reporter="r", block=4)
        e.peer_id = "n"
        return e

    retrier, view, _ = make()
    view.live = {("n", 4)}  # this client's own read finds n serving block 4: the reporter's view lags, or it lies
    for _ in range(3):
        retrier.note_failure(unseen())
    assert view.bans == [] and retrier.failures == {} and retrier.contradicted == {"r": 3}
    assert view.busied == [("r", 2.0), ("r", 4.0), ("r", 8.0)]  # set aside, longer each time
    retrier, view, _ = make()  # n serves other blocks now (it moved): it is the one failed
    view.live = {("n", 9)}
    retrier.note_failure(unseen())
    assert view.bans == [("n", 2.0)] and retrier.failures == {"n": 1} and view.busied == []
