"""Busy is not dead, in parts: a server found slow but alive is never banned by the retry helper, and routing prices
it dearer for new sessions for a while (and waits longer for its steps); an unmeasured replica competes for new
sessions with the one measured first instead of losing to its own understated claim."""

from __future__ import annotations

import asyncio
from collections import Counter

import torch

from swarm.client.retry import Retrier
from swarm.client.routing import choose_route
from swarm.client.swarm_view import MAX_PATIENCE, SLOW_LOAD, SwarmView
from swarm.config import ClientConfig, Timing
from swarm.errors import PeerUnavailableError, SlowPeerError
from tests.helpers.records import record, view_of


class FakeView:
    """The bans the retry helper hands out, recorded."""

    def __init__(self) -> None:
        self.bans: list[tuple[str, float]] = []
        self.busied: list[tuple[str, float]] = []

    def ban(self, peer: str, seconds: float) -> None:
        self.bans.append((peer, seconds))

    def unban(self, peer: str) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def busy(self, peer: str, seconds: float) -> None:
        self.busied.append((peer, seconds))

    def parole(self) -> frozenset[str]:
        return frozenset()

    def listed(self, peer: str, block: int) -> bool:
        return False


class _Store:
    def __init__(self, view):
        self._view = view

    def view(self, model_id, num_blocks, enough=None):
        return self._view


def test_a_slow_peer_is_failed_over_without_a_ban():
    view = FakeView()
    retrier = Retrier(view, Timing(retry_budget=10.0, ban_base=2.0), clock=lambda: 0.0, sleep=lambda s: None)
    slow, dead = SlowPeerError("slow"), PeerUnavailableError("dead")
    slow.peer_id, dead.peer_id = "busy", "gone"
    attempts = iter([slow, dead, None])

    def attempt() -> str:
        e = next(attempts)
        if e is not None:
            raise e
        return "ok"

    assert retrier.run(attempt) == "ok" and retrier.failovers == 2
    assert [peer for peer, _ in view.bans] == ["gone"] and "busy" not in retrier.failures


def test_a_slow_peer_repels_new_sessions_for_a_while_and_gets_patience():
    replicas = [record(peer_id=p, start=0, end=8) for p in ("busy", "idle")]
    sv = SwarmView(_Store(view_of(*replicas)), "m", 8, ClientConfig())
    assert sv.patience("busy") == 1.0
    sv.slow("busy", 60.0)
    assert sv.slowed() == {"busy"} and "busy" not in sv.banned()
    assert sv.session_load(replicas) == {"busy": SLOW_LOAD, "idle": 1.0}
    assert [h.peer_id for h in sv.route(0, 8)] == ["idle"]
    sv.slow("busy", 60.0)
    sv.slow("busy", 60.0)
    sv.slow("busy", 60.0)
    assert sv.patience("busy") == MAX_PATIENCE  # 2, 4, 8, then no more
    sv.slow("busy", -1.0)  # set aside no longer: priced by its load alone again
    assert sv.slowed() == frozenset() and sv.session_load(replicas)["busy"] == 1.0


def test_new_sessions_explore_replicas_never_measured():
    """One replica measured (faster than every claim, as a loopback measurement is), three only claimed: new
    sessions priced by load spread over all four instead of piling on the measured one."""
    replicas = [record(peer_id=f"r{i}", start=0, end=8, inference_sps=10.0) for i in range(4)]
    measured = {"r0": 1.0 / (100.0 * 8)}  # ten times its claim
    counts: Counter[str] = Counter()
    for _ in range(32):
        load = {r.peer_id: 1.0 + 0.25 * counts[r.peer_id] for r in replicas}
        counts[choose_route(replicas, 0, 8, measured=measured, load=load)[0].peer_id] += 1
    assert set(counts) == {"r0", "r1", "r2", "r3"} and max(counts.values()) <= 8 * 1.2, counts
    without = choose_route(replicas, 0, 8, measured=measured)  # no load, no noise: the measured one, as before
    assert without[0].peer_id == "r0"


class _Channel:
    """A push connection the next hop closes at once (its ``receive`` ends), after ``send`` was written to it."""

    def __init__(self) -> None:
        self.decoder = None
        self.closed = asyncio.Event()

    def write(self, frames) -> None:
        pass

    async def send(self, frames) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def receive(self):
        await self.closed.wait()
        return None

    def close(self) -> None:
        self.closed.set()


class _Remote:
    def __init__(self, fail: bool) -> None:
        self.fail, self.channel = fail, _Channel()

    async def open_channel(self, hop, rpc):
        if self.fail:
            raise ConnectionRefusedError("the relay is gone")
        return self.channel


def test_a_push_connection_that_fails_reports_the_sessions_that_pushed_through_it():
    """A dial refused, or the next hop closing the stream under pushes, tells ``lost`` of every session that pushed
    through the link and is still routed there (once); a stream the next hop closes after it idled is not a failure."""
    from peers.rpc.push_link import PushLink
    from peers.serving.counters import PeerMetrics
    from peers.serving.sessions import Session
    from swarm.hop import Hop
    from swarm.ids import Span

    async def lost_by(remote: _Remote, idle: bool) -> list[list[str]]:
        lost: list[list[str]] = []
        timing = Timing()
        link = PushLink(
            remote, Hop("next", 0, 1), PeerMetrics(), None, timing, lambda s: lost.append([x.id for x in s])
        )
        sessions = [Session(sid, Span(0, 2), 64, 1, None, 64, caller="c") for sid in ("a", "b", "moved")]  # open
        for s in sessions:  # pushed while the dial is under way: queued
            s.next_hop = record(peer_id="next", start=1, end=2)
            link.send([], "c", s)
        sessions[2].next_hop = record(peer_id="elsewhere", start=1, end=2)  # its client moved it since: not lost
        if idle:
            link.last_used -= timing.stream_idle
        for _ in range(100):  # each turn of the loop lets the link's task go one step further (no timer involved)
            await asyncio.sleep(0)
            if link.channel is not None and not remote.channel.closed.is_set():
                remote.channel.close()  # the next hop ends the stream
        assert link.dead
        return lost

    assert asyncio.run(lost_by(_Remote(fail=True), idle=False)) == [["a", "b"]]
    assert asyncio.run(lost_by(_Remote(fail=False), idle=False)) == [["a", "b"]]
    assert asyncio.run(lost_by(_Remote(fail=False), idle=True)) == []


def test_both_sides_of_a_dispute_nothing_decided_lose_new_sessions_while_others_serve_their_blocks():
    """A hop and its verifier disagreed and this client could decide nothing (no weights here, no third server
    that agreed with either): neither is banned, but new sessions go to the third replica, whatever speed the two
    claim; a span only the two serve is still routed through them."""
    from types import SimpleNamespace

    from swarm.client.verify.verdicts import act
    from swarm.client.verify.verifier import Verdict
    from swarm.hop import Hop
    from swarm.verdict import compare

    claims = {"cheater": 100.0, "honest": 10.0, "other": 10.0}  # the cheater claims ten times the others' speed
    replicas = [record(peer_id=p, start=0, end=8, inference_sps=sps) for p, sps in claims.items()]
    sv = SwarmView(_Store(view_of(*replicas)), "m", 8, ClientConfig())
    assert [h.peer_id for h in sv.route(0, 8)] == ["cheater"]
    hop, verifier = (Hop.of(r) for r in replicas[:2])
    state = SimpleNamespace(hop=hop, link=SimpleNamespace(broken=False))
    shadow = SimpleNamespace(hop=verifier, close=lambda: None)
    disputed = Verdict(state, "unresolved", compare(torch.zeros(1, 2, 4), torch.ones(1, 2, 4)), shadow=shadow)
    assert act([disputed], SimpleNamespace(view=sv), chunk=0) == []  # nobody caught...
    assert state.link.broken and sv.banned() == frozenset()  # ...the session moves off the hop, nobody banned
    assert sv.disputed() == {"cheater", "honest"}
    assert [h.peer_id for h in sv.route(0, 8)] == ["other"]
    sv2 = SwarmView(_Store(view_of(*replicas[:2])), "m", 8, ClientConfig())
    sv2.dispute("cheater", 600.0)
    sv2.dispute("honest", 600.0)
    assert len(sv2.route(0, 8)) == 1  # only the two serve the blocks: still routed
