"""The planner on heterogeneous swarms, and the election with an injected clock."""

from __future__ import annotations

import random

from peers.broker.election import Election, Lease
from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm, settled
from swarm.ids import Span
from swarm.lease import LeaseRules, LeaseView, tie_break, well_formed, winner
from swarm.records import Assignment, Placement

GB = 1024**3


def test_full_coverage_and_memory_limits():
    peers = [PeerInfo(f"p{i}", 1.0, 10 * GB) for i in range(6)] + [PeerInfo("big", 5.0, 80 * GB)]
    plan = plan_swarm(peers, 40, 2 * GB, Policy(standby_fraction=0.0))
    for pid, pl in plan.placements.items():
        cap = 5 if pid != "big" else 40
        assert len(pl.span) <= cap
    served = {b for pl in plan.placements.values() for b in range(pl.span.start, pl.span.end)}
    assert served == set(range(40)) and plan.bottleneck > 0


def test_heterogeneous_bottleneck_near_upper_bound():
    rng = random.Random(0)
    kinds = [(10, 1.0), (24, 2.5), (80, 5.0)]
    peers = [PeerInfo(f"p{i}", *reversed(kinds[rng.randrange(3)])) for i in range(60)]
    peers = [PeerInfo(p.peer_id, p.throughput, int(p.memory) * GB) for p in peers]
    plan = plan_swarm(peers, 24, 2 * GB, Policy(standby_fraction=0.0))
    assert plan.bottleneck >= 0.85 * plan.upper_bound


def test_pinned_peers_never_move_and_too_small_peers_are_reported():
    pinned = PeerInfo("pinned", 1.0, 100 * GB, pinned=Span(0, 3))
    tiny = PeerInfo("tiny", 1.0, GB // 2)
    plan = plan_swarm([pinned, tiny, PeerInfo("free", 1.0, 100 * GB)], 8, GB)
    assert plan.placements["pinned"].span == Span(0, 3)
    assert plan.unplaceable == ("tiny",) and "tiny" not in plan.placements


def test_hysteresis_keeps_serving_peers_put():
    peers = [PeerInfo(f"p{i}", 1.0 + 0.01 * i, 4 * GB) for i in range(8)]
    first = plan_swarm(peers, 16, GB, Policy(standby_fraction=0.0))
    current = settled(peers, first)
    # a slightly faster newcomer must not shuffle everyone
    again = plan_swarm([*current, PeerInfo("new", 1.05, 4 * GB)], 16, GB, Policy(standby_fraction=0.0))
    assert again.moves_from(current) <= 1


def test_standby_pool_and_promotion():
    peers = [PeerInfo(f"p{i}", 1.0 + i * 0.1, 4 * GB) for i in range(10)]
    plan = plan_swarm(peers, 8, GB, Policy(replication=2, standby_fraction=0.2))
    standbys = [pid for pid, pl in plan.placements.items() if pl.role == Role.STANDBY]
    assert len(standbys) == 2
    current = settled(peers, plan)
    # every server of some block leaves: a standby holding that block is promoted without loading anything
    hole = plan.placements[standbys[0]].span.start
    gone = {p.peer_id for p in current if p.role == Role.SERVE and hole in p.span}
    after = plan_swarm(
        [p for p in current if p.peer_id not in gone], 8, GB, Policy(replication=2, standby_fraction=0.2)
    )
    promoted = after.placements[standbys[0]]
    assert promoted.role == Role.SERVE and promoted.span == plan.placements[standbys[0]].span


class FakeStore:
    def __init__(self):
        self.leases: dict[str, Lease] = {}

    def read(self):
        return list(self.leases.values())

    def write(self, lease):
        self.leases[lease.holder] = lease


RULES = LeaseRules(lease_seconds=10, max_tenure=60, term_step=2, skew=1.0)


def test_election_lease_expiry_and_takeover():
    now = [0.0]
    store = FakeStore()
    a = Election("a", store, lambda: now[0], RULES)
    b = Election("b", store, lambda: now[0], RULES)
    assert a.tick() is not None and a.held.term == 1
    assert b.tick() is None  # a holds it
    now[0] = 5.0
    assert a.tick().expires == 15.0 and a.held.start == 0.0  # renewed, same tenure
    now[0] = 30.0  # a went silent: its lease lapsed
    assert b.tick().term == 2 and a.tick() is None  # b takes term 2; a, back, does not reclaim while b renews
    assert LeaseView(RULES).resolve(store.read(), now[0]).holder == "b"


def test_a_higher_claim_does_not_pre_empt_a_live_lease():
    now = [0.0]
    store = FakeStore()
    a = Election("a", store, lambda: now[0], RULES)
    follower = LeaseView(RULES)
    a.tick()
    assert follower.resolve(store.read(), now[0]).holder == "a"
    store.write(Lease(term=2, holder="x", start=1.0, expires=11.0))  # x claims while a holds the role
    for t in (1.0, 4.0, 8.0, 12.0):
        now[0] = t
        a.tick()  # a renews
        assert follower.resolve(store.read(), t).holder == "a"
    assert LeaseView(RULES).resolve(store.read(), 8.0).holder == "x"  # only a newcomer, with nothing obeyed, sees x


def test_a_huge_term_silences_nobody_and_ties_cannot_be_ground():
    now = [0.0]
    store = FakeStore()
    a = Election("a", store, lambda: now[0], RULES)
    b = Election("b", store, lambda: now[0], RULES)
    a.tick()
    b.tick()
    now[0] = 20.0  # a died
    store.leases.pop("a")
    store.write(Lease(term=10**9, holder="x", start=20.0, expires=30.0))  # a leap in terms
    assert b.tick() is not None and b.held.term == 2  # b obeyed term 1: it refuses the leap and takes term 2
    assert b.view.current.holder == "b"
    # two claims of one term: the winner is whoever the hash of the term and both ids picks, whatever the ids are
    tie = [Lease(term=5, holder=h, start=0.0, expires=10.0) for h in ("aaaa", "zzzz")]
    expected = min(tie, key=lambda lease: tie_break(lease, ["aaaa", "zzzz"]))
    assert winner(tie, 1.0, RULES) == winner(list(reversed(tie)), 1.0, RULES) == expected


def test_malformed_leases_are_refused_and_tenure_is_bounded():
    far = Lease(term=1, holder="x", start=0.0, expires=10_000.0)  # would hold the role without renewing
    old = Lease(term=1, holder="y", start=-100.0, expires=5.0)  # a tenure longer than allowed
    assert not well_formed(far, 0.0, RULES) and not well_formed(old, 0.0, RULES)
    assert winner([far, old], 0.0, RULES) is None
    now = [0.0]
    store = FakeStore()
    a = Election("a", store, lambda: now[0], RULES)
    b = Election("b", store, lambda: now[0], RULES)
    holders = []
    for t in range(0, 130, 2):
        now[0] = float(t)
        a.tick()
        b.tick()
        current = LeaseView(RULES).resolve(store.read(), now[0])
        holders.append(current.holder if current else None)
    assert holders[0] == "a" and "b" in holders  # a's tenure ran out and b took a turn
    assert (
        max(store.leases["a"].expires - store.leases["a"].start, store.leases["b"].expires - store.leases["b"].start)
        <= RULES.max_tenure
    )


def test_a_restamped_renewal_and_a_claim_kept_waiting_win_nothing():
    follower = LeaseView(RULES)
    assert follower.resolve([Lease(term=1, holder="a", start=0.0, expires=10.0)], 1.0).holder == "a"
    # a renewal that restarts the tenure is not a renewal: the lease it follows lapses at 10
    restamped = Lease(term=1, holder="a", start=8.0, expires=18.0)
    waiting = Lease(term=3, holder="x", start=5.0, expires=15.0)  # claimed during a's lease, renewed since
    fair = Lease(term=2, holder="b", start=10.5, expires=20.5)  # claimed once a's lease had lapsed
    assert follower.resolve([restamped, waiting], 9.0) is None or follower.current.holder == "a"
    assert follower.resolve([restamped, waiting, fair], 11.0).holder == "b"


def test_a_lease_at_the_largest_term_does_not_stop_fresh_candidates():
    from swarm.records import MAX_COUNT

    store = FakeStore()
    store.write(Lease(term=MAX_COUNT, holder="x", start=0.0, expires=1.0))  # expired, still well-formed
    a = Election("a", store, lambda: 5.0, RULES)
    assert a.tick() is not None and a.held.term < MAX_COUNT


def test_only_the_obeyed_holder_assigns_for_its_term():
    view = LeaseView(RULES)
    view.resolve([Lease(term=3, holder="b", start=0.0, expires=10.0)], 1.0)
    plan = dict(issued_at=1.0, placements={"p": Placement(start=0, end=2, role="serve")})
    assert view.obeys(Assignment(term=3, broker="b", **plan))
    assert not view.obeys(Assignment(term=4, broker="b", **plan))  # no lease for that term
    assert not view.obeys(Assignment(term=10**9, broker="x", **plan))  # a forged one


def test_a_peer_without_room_for_one_block_is_told_so(monkeypatch):
    import dataclasses

    import pytest

    from peers import run
    from peers.config import PeerConfig, PlacementConfig
    from peers.serving.stage_port import ModelInfo
    from swarm.errors import BadInputError

    config = type("C", (), {"num_hidden_layers": 30, "hidden_size": 8})()
    model = ModelInfo("m", config, None, None, "fp", 4 * GB)  # type: ignore[arg-type]
    monkeypatch.setattr(run, "usable_memory", lambda device: 3 * GB)
    with pytest.raises(BadInputError, match="too little memory for even one block of m"):
        run.max_blocks(PeerConfig(), model)
    monkeypatch.setattr(run, "usable_memory", lambda device: 9 * GB)
    assert run.max_blocks(PeerConfig(), model) == 2
    capped = dataclasses.replace(PeerConfig(), placement=PlacementConfig(max_blocks=1))
    assert run.max_blocks(capped, model) == 1


def test_slow_links_cap_a_peer_and_favour_long_spans():
    # a data-centre card behind a thin link: its share of each block is capped by what its link can carry
    fast_link = PeerInfo("dc", 8.0, 80 * GB)
    thin_link = PeerInfo("home-dc", 8.0, 80 * GB, link_tokens=0.2)
    consumer = [PeerInfo(f"c{i}", 1.0, 10 * GB) for i in range(8)]
    plan_fast = plan_swarm([fast_link, *consumer], 16, 2 * GB, Policy(standby_fraction=0.0))
    plan_thin = plan_swarm([thin_link, *consumer], 16, 2 * GB, Policy(standby_fraction=0.0))
    assert plan_thin.bottleneck < plan_fast.bottleneck
    assert plan_thin.upper_bound < plan_fast.upper_bound
    assert len(plan_thin.placements["home-dc"].span) == 16  # the longest span it can hold: fewest crossings


def test_live_peers_drop_missed_heartbeats_and_convert_links():
    from peers.broker.loop import live_peers
    from swarm.records import PeerRecord, PeerState

    def rec(pid, updated, **kw):
        fields = dict(state=PeerState.ONLINE, start=0, end=2, block_throughput=10.0, memory=GB, max_blocks=2)
        return PeerRecord(peer_id=pid, updated_at=updated, **{**fields, **kw})

    peers = live_peers(
        [
            rec("fresh", 99.0, network_mbps=8.0, token_bytes=1000),
            rec("silent", 80.0),
            rec("leaving", 99.0).model_copy(update={"state": PeerState.LEAVING}),
            rec("from-the-future", 10_000.0),  # would never go stale
            # joining, speed not measured yet (a peer behind NAT heartbeats before it reserves relay slots): it
            # waits; measured, it is placed
            rec("unmeasured", 99.0, block_throughput=0.0, start=None, end=None, state=PeerState.JOINING),
            rec("measured", 99.0, start=None, end=None, state=PeerState.JOINING),
        ],
        now=100.0,
        heartbeat_timeout=15.0,
        skew=1.0,
    )
    assert [p.peer_id for p in peers] == ["fresh", "measured"]
    assert peers[0].link_tokens == 500.0 and peers[0].role == Role.SERVE and peers[0].span == Span(0, 2)


def test_followers_refuse_harmful_plans():
    from peers.follower import refusal
    from swarm.records import PeerState
    from tests.helpers.records import record, view_of

    def plan(**placements):
        return Assignment(
            term=1,
            broker="b",
            issued_at=0.0,
            placements={p: Placement(start=s, end=e, role=r) for p, (s, e, r) in placements.items()},
        )

    view = view_of(
        *(record(peer_id=f"p{i}", start=0, end=8) for i in range(4)),
        record(peer_id="solo", start=4, end=8),
        record(peer_id="only", start=0, end=4),
    )
    serve = Role.SERVE
    assert refusal(plan(only=(4, 8, "serve")), "only", Span(0, 4), serve, 4, view) is None  # p0..p3 cover 0:4
    lonely = view_of(record(peer_id="only", start=0, end=4), record(peer_id="q", start=4, end=8))
    assert "would have no other server" in refusal(plan(only=(4, 8, "serve")), "only", Span(0, 4), serve, 4, lonely)
    assert "would have no other server" in refusal(plan(only=(0, 4, "standby")), "only", Span(0, 4), serve, 4, lonely)
    assert "more than this peer's 2" in refusal(plan(only=(0, 4, "serve")), "only", None, None, 2, lonely)
    many = plan(**{f"p{i}": (0, 8, "standby") for i in range(3)}, only=(0, 4, "serve"))
    assert "demotes 3 of 6" in refusal(many, "only", Span(0, 4), serve, 4, view)
    joining = view_of(record(peer_id="j", start=0, end=8, state=PeerState.JOINING))
    assert refusal(plan(j=(0, 8, "standby")), "j", None, None, 8, joining) is None
    # two peers that each see the other on 4:8: a plan moving both away is refused by both (each asks whether the
    # other stays there under the plan, not only whether it is there now)
    pair = view_of(
        record(peer_id="a", start=0, end=4), record(peer_id="x", start=4, end=8), record(peer_id="y", start=4, end=8)
    )
    away = plan(a=(0, 4, "serve"), x=(0, 4, "serve"), y=(0, 4, "serve"))
    assert "would have no other server" in refusal(away, "x", Span(4, 8), serve, 4, pair)
    assert "would have no other server" in refusal(away, "y", Span(4, 8), serve, 4, pair)
    assert (
        refusal(plan(a=(0, 4, "serve"), x=(0, 4, "serve"), y=(4, 8, "serve")), "x", Span(4, 8), serve, 4, pair) is None
    )
