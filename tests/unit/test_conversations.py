"""The API's kept sessions (``swarm.api.conversations``), with stand-in sessions: a caller's next turn goes on from
the session whose tokens are the longest proper prefix of its prompt and that has room for the answer; another
caller's are never used; the limits per caller, in all and in KV room close the least recently used; idle ones are
closed; a session that does not hold what it says is closed, not kept."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.api.conversations import Conversations


@dataclass
class Stub:
    max_length: int
    position: int
    batch_size: int = 1
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def kept(**kw) -> tuple[Conversations, list[float]]:
    now = [0.0]
    return Conversations(clock=lambda: now[0], **kw), now


def test_the_longest_prefix_of_the_callers_own_sessions_with_room_is_taken():
    c, _ = kept(per_caller=3)
    short, long_, tight = Stub(100, 3), Stub(100, 5), Stub(8, 6)
    c.give("a", short, [1, 2, 3])
    c.give("a", long_, [1, 2, 3, 4, 5])
    c.give("a", tight, [1, 2, 3, 4, 5, 6])  # the longest prefix, but no room for 4 more tokens after the prompt
    assert c.take("b", [1, 2, 3, 4, 5, 6, 7], 4) is None  # another caller's: never
    assert c.take("a", [1, 2, 3, 4, 5, 6, 7], 4) == (long_, 5)
    # the outgrown one was closed meanwhile, so its servers keep its prefix for the larger session this opens
    assert tight.closed and not short.closed
    assert c.take("a", [1, 2, 3, 4, 5, 6, 7], 4) == (short, 3)  # taken out: one request at a time uses one
    assert c.take("a", [1, 2, 3], 4) is None  # a prompt no longer than what is held: nothing new to compute from
    assert c.take("a", [9, 2, 3, 4], 4) is None  # not a prefix


def test_limits_close_the_least_recently_used_and_idle_ones_close():
    c, now = kept(per_caller=2, total=3, idle=10.0)
    sessions = [Stub(100, 1) for _ in range(5)]
    for i, s in enumerate(sessions[:3]):
        now[0] = float(i)
        c.give("a", s, [i])
    assert sessions[0].closed and not sessions[1].closed and c.held() == 2  # two per caller
    now[0] = 3.0
    c.give("b", sessions[3], [3])
    now[0] = 4.0
    c.give("c", sessions[4], [4])  # four kept: over the total of three, the oldest goes
    assert sessions[1].closed and c.held() == 3
    now[0] = 13.5  # idle for over 10 s: the ones given at 2 and 3
    c.expire()
    assert sessions[2].closed and sessions[3].closed and not sessions[4].closed and c.held() == 1
    c.close()
    assert all(s.closed for s in sessions)


def test_kept_room_is_bounded_in_tokens():
    c, now = kept(per_caller=8, room=lambda: 250)
    a, b, d = Stub(100, 1), Stub(100, 1), Stub(100, 1, batch_size=2)
    c.give("a", a, [1])
    now[0] = 1.0
    c.give("b", b, [1])
    now[0] = 2.0
    c.give("c", d, [1])  # 100 + 100 + 200 tokens of room: the least recently used go until 250 holds
    assert a.closed and b.closed and not d.closed


def test_a_session_that_does_not_hold_what_it_says_or_a_disabled_pool_keeps_nothing():
    c, _ = kept()
    wrong = Stub(100, position=4)
    c.give("a", wrong, [1, 2, 3])
    assert wrong.closed and c.held() == 0
    off, _ = kept(per_caller=0)
    s = Stub(100, 2)
    off.give("a", s, [1, 2])
    assert s.closed and off.take("a", [1, 2, 3], 1) is None
