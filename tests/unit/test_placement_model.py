"""The performance model's scoring of placements (the broker) and routes (the client): measured round trips, link
bandwidth, chained vs client-mediated pricing, the Petals-style baseline (joining and rebalancing), determinism."""

from __future__ import annotations

import math

import pytest

from peers.broker.planner import PeerInfo, Policy, plan_swarm
from swarm.client.routing import choose_route
from swarm.perf.arch import Arch
from swarm.perf.catalogue import load_catalogue
from swarm.perf.model import Link
from swarm.perf.placement import (
    RouteCosts,
    block_throughput,
    bottleneck,
    device_of,
    greedy_spans,
    hop_seconds,
    link_tokens,
    peer_rate,
    petals_rebalance,
    span_seconds_per_token,
)
from tests.helpers.records import record

LLAMA70B = Arch(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000, head_dim=128)


def peers_of(route):
    return [(h.peer_id, h.start, h.end) for h in route]


def test_throughput_rule_is_the_slower_of_compute_and_link():
    assert peer_rate(8.0, 4) == 2.0
    assert peer_rate(8.0, 4, link_tokens=0.5) == 0.5
    assert link_tokens(Link(bandwidth=1000.0), token_bytes=10.0) == 50.0  # in and out
    assert link_tokens(Link(), token_bytes=10.0) == math.inf


def test_latency_terms_add():
    link = Link(delay=0.01, bandwidth=1000.0)
    assert span_seconds_per_token(0.002, 5, link, token_bytes=10.0, software=0.001) == pytest.approx(0.031)
    # client-mediated: there and back (two delays, the bytes twice); chained: passed on once
    assert hop_seconds(link, 100.0, software=0.001, compute=0.05) == pytest.approx(2 * 0.11 + 0.051)
    assert hop_seconds(link, 100.0, software=0.001, compute=0.05, chained=True) == pytest.approx(0.11 + 0.051)


def test_default_costs_reproduce_the_flat_prior():
    costs = RouteCosts.from_prior(0.003)
    assert costs == RouteCosts()
    assert costs.hop(None, None) == pytest.approx(0.003)
    assert costs.hop(None, 10.0) == pytest.approx(0.003)  # no bytes priced: bandwidth does not matter
    assert RouteCosts.from_prior(0.003, software=0.001).hop(None, None) == pytest.approx(0.003)


def test_a_far_peer_loses_to_a_near_one_of_equal_speed():
    far = record(peer_id="far", start=0, end=8, inference_sps=10.0)
    near = record(peer_id="near", start=0, end=8, inference_sps=10.0)
    assert peers_of(choose_route([far, near], 0, 8))[0][0] == "far"  # unmeasured: a tie, the first wins
    assert peers_of(choose_route([far, near], 0, 8, rtt={"far": 0.1}))[0][0] == "near"
    assert peers_of(choose_route([far, near], 0, 8, rtt={"far": 0.1, "near": 0.005}))[0][0] == "near"
    assert peers_of(choose_route([near, far], 0, 8, rtt={"near": 0.1, "far": 0.005}))[0][0] == "far"


def test_a_slow_link_loses_for_big_prompts_but_not_for_tiny_steps_when_faster():
    thin = record(peer_id="thin", start=0, end=8, inference_sps=20.0, network_mbps=10.0)  # 4x faster compute
    wide = record(peer_id="wide", start=0, end=8, inference_sps=5.0, network_mbps=1000.0)
    step = RouteCosts(token_bytes=8192 * 2, tokens=1)
    prompt = RouteCosts(token_bytes=8192 * 2, tokens=512)
    assert peers_of(choose_route([wide, thin], 0, 8, costs=step))[0][0] == "thin"
    assert peers_of(choose_route([thin, wide], 0, 8, costs=prompt))[0][0] == "wide"


def test_chained_and_mediated_pricing_differ():
    # one farther server for everything, or two nearer ones: a round trip per hop (mediated) makes the delays
    # count double, so the per-hop software cost weighs less and the two near hops win; chained, the far one wins
    far = record(peer_id="far", start=0, end=8, inference_sps=10.0)
    a = record(peer_id="a", start=0, end=4, inference_sps=20.0)
    b = record(peer_id="b", start=4, end=8, inference_sps=20.0)
    rtt = {"far": 0.03, "a": 0.01, "b": 0.01}
    mediated = RouteCosts(software=0.008)
    chained = RouteCosts(software=0.008, chained=True)
    assert peers_of(choose_route([far, a, b], 0, 8, rtt=rtt, costs=mediated)) == [("a", 0, 4), ("b", 4, 8)]
    assert peers_of(choose_route([far, a, b], 0, 8, rtt=rtt, costs=chained)) == [("far", 0, 8)]
    assert mediated.hop(0.03, None) == pytest.approx(0.038)
    assert chained.hop(0.03, None) == pytest.approx(0.023)


def test_routes_and_plans_are_deterministic():
    recs = [record(peer_id=f"p{i}", start=i % 4, end=4 + i % 5, inference_sps=1.0 + i) for i in range(8)]
    rtt = {f"p{i}": 0.001 * i for i in range(8)}
    costs = RouteCosts(token_bytes=4096, tokens=16)
    first = peers_of(choose_route(recs, 0, 8, rtt=rtt, costs=costs))
    assert all(peers_of(choose_route(recs, 0, 8, rtt=rtt, costs=costs)) == first for _ in range(5))
    peers = [PeerInfo(f"q{i}", 1.0 + i % 3, (2 + i % 4) * 2**30, link_tokens=0.5 + i) for i in range(12)]
    plans = [plan_swarm(peers, 16, 2**30, Policy(standby_fraction=0.0)) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]


def test_greedy_baseline_covers_the_weakest_block_first_and_never_moves():
    rates = [(4.0, math.inf), (4.0, math.inf), (2.0, math.inf), (1.0, 0.1)]
    spans = greedy_spans(rates, [4, 4, 8, 2], num_blocks=8, seed=0)
    assert greedy_spans(rates, [4, 4, 8, 2], num_blocks=8, seed=0) == spans  # seeded
    assert all(end - start == cap for (start, end), cap in zip(spans, [4, 4, 8, 2], strict=True))
    # the two 4-block peers split the model (whatever the order, the second finds the other half empty)
    assert {spans[0], spans[1]} == {(0, 4), (4, 8)}
    assert bottleneck(spans, rates, 8) == pytest.approx(1.0 + 0.25)
    assert greedy_spans([(1.0, math.inf)], [0], 4) == [(0, 0)]


def test_catalogue_devices_predict_memory_bound_decode():
    cat = load_catalogue()
    small, big = device_of(cat["rtx3080"]), device_of(cat["h100"])
    assert small.memory == pytest.approx(cat["rtx3080"].memory_bytes - 1e9)
    weights = LLAMA70B.block_bytes(2)
    for dev in (small, big):
        rate = block_throughput(dev, LLAMA70B, batch=16)
        assert 0.7 * 16 * dev.bandwidth / weights < rate <= 16 * dev.bandwidth / weights
    assert block_throughput(big, LLAMA70B) > 2 * block_throughput(small, LLAMA70B)


def test_petals_servers_move_only_for_a_gain_of_more_than_a_third():
    # 4 blocks, spans of 2; A, B and C add 1 to each of their blocks, D 0.2: the weakest block (3) has 1
    rates = [(2.0, math.inf), (2.0, math.inf), (2.0, math.inf), (0.4, math.inf)]
    spans = [(0, 2), (0, 2), (2, 4), (1, 3)]
    assert bottleneck(spans, rates, 4) == pytest.approx(1.0)
    # D moving to 2:4 would make it 1.2: a fifth more, under Petals' threshold (balance quality 0.75)
    assert petals_rebalance(spans, rates, 4, seed=0) == (spans, 0)
    moved, moves = petals_rebalance(spans, rates, 4, seed=0, quality=0.9)  # a stricter quality: it moves
    assert (moved[3], moves) == ((2, 4), 1) and bottleneck(moved, rates, 4) == pytest.approx(1.2)
    assert moved[:3] == spans[:3]  # the others were already where they help most


def test_petals_servers_fill_a_hole_left_by_leavers():
    rates = [(1.0, math.inf)] * 2
    spans = [(0, 4), (0, 4)]  # the two peers that served 4:8 left
    assert bottleneck(spans, rates, 8) == 0.0
    moved, moves = petals_rebalance(spans, rates, 8, seed=3)
    assert moves == 1 and sorted(moved) == [(0, 4), (4, 8)] and bottleneck(moved, rates, 8) == pytest.approx(0.25)
    assert petals_rebalance(spans, rates, 8, seed=3) == (moved, moves)  # seeded
