"""The planner on heterogeneous swarms, and the election with an injected clock."""

from __future__ import annotations

import random

from peers.broker.election import Election, Lease, newest_assignment, winner
from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm, settled
from swarm.ids import Span

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


def test_election_lease_expiry_contenders_and_stale_terms():
    now = [0.0]
    store = FakeStore()
    a = Election("a", store, lambda: now[0], lease_seconds=10)
    b = Election("b", store, lambda: now[0], lease_seconds=10)
    assert a.tick() is not None and a.held.term == 1
    assert b.tick() is None  # a holds it
    now[0] = 5.0
    assert a.tick().expires == 15.0  # renewed
    now[0] = 30.0  # a went silent: its lease lapsed
    assert b.tick().term == 2 and a.tick() is None  # b wins term 2; a, back, does not reclaim
    assert winner(store.read(), now[0]).holder == "b"
    # two contenders claiming the same term resolve to the same winner
    store2 = FakeStore()
    store2.write(Lease(term=3, holder="y", expires=100.0))
    store2.write(Lease(term=3, holder="x", expires=100.0))
    assert winner(store2.read(), 0.0).holder == "x"
    # a claim that lost a tie and lingers does not make its owner broker later with that same term
    store3 = FakeStore()
    x = Election("x", store3, lambda: now[0], lease_seconds=10)
    z = Election("z", store3, lambda: now[0], lease_seconds=10)
    assert x.tick().term == 1
    store3.write(Lease(term=1, holder="z", expires=now[0] + 10))  # z claimed term 1 at once and lost the tie to x
    assert z.tick() is None and x.tick().term == 1
    now[0] += 10.5  # x dies silently; z's old claim (written later) would still be valid...
    store3.write(Lease(term=1, holder="z", expires=now[0] + 5))
    assert z.tick().term == 2  # ...but z takes over with a fresh term
    # followers obey the newest (term, broker) and never go back
    seen = newest_assignment([(2, "b")], None)
    assert newest_assignment([(1, "a")], seen) == (2, "b")
    assert newest_assignment([(3, "z"), (3, "c")], seen) == (3, "c")


def test_a_peer_without_room_for_one_block_is_told_so(monkeypatch):
    import dataclasses

    import pytest

    from peers import node
    from peers.config import PeerConfig, PlacementConfig
    from peers.stage import ModelInfo
    from swarm.errors import BadInputError

    config = type("C", (), {"num_hidden_layers": 30, "hidden_size": 8})()
    model = ModelInfo("m", config, None, None, "fp", 4 * GB)  # type: ignore[arg-type]
    monkeypatch.setattr(node, "usable_memory", lambda device: 3 * GB)
    with pytest.raises(BadInputError, match="too little memory for even one block of m"):
        node.max_blocks(PeerConfig(), model)
    monkeypatch.setattr(node, "usable_memory", lambda device: 9 * GB)
    assert node.max_blocks(PeerConfig(), model) == 2
    capped = dataclasses.replace(PeerConfig(), placement=PlacementConfig(max_blocks=1))
    assert node.max_blocks(capped, model) == 1


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
        return PeerRecord(
            peer_id=pid,
            state=PeerState.ONLINE,
            start=0,
            end=2,
            block_throughput=10.0,
            memory=GB,
            max_blocks=2,
            updated_at=updated,
            **kw,
        )

    peers = live_peers(
        [
            rec("fresh", 99.0, network_mbps=8.0, token_bytes=1000),
            rec("silent", 80.0),
            rec("leaving", 99.0).model_copy(update={"state": PeerState.LEAVING}),
        ],
        now=100.0,
        heartbeat_timeout=15.0,
    )
    assert [p.peer_id for p in peers] == ["fresh"]
    assert peers[0].link_tokens == 500.0 and peers[0].role == Role.SERVE and peers[0].span == Span(0, 2)
