"""Routing over a swarm view: coverage, overlaps, mid-span entry, speed, bans, fingerprints, missing blocks, and
the capabilities a route needs of a server's runtime."""

from __future__ import annotations

from collections import Counter

import pytest

from swarm.client.routing import choose_route, eligible, pick_fingerprint
from swarm.errors import MissingBlocksError
from swarm.hop import Hop
from swarm.records import ALL_CAPABILITIES, Capability, PeerState, parse_record
from tests.helpers.records import record, view_of


def spans(route):
    return [(h.peer_id, h.start, h.end) for h in route]


def test_chain_covers_all_blocks_and_prefers_fewer_hops():
    recs = [
        record(peer_id="a", start=0, end=4),
        record(peer_id="b", start=4, end=8),
        record(peer_id="c", start=0, end=8),
    ]
    assert spans(choose_route(recs, 0, 8)) == [("c", 0, 8)]
    assert spans(choose_route(recs[:2], 0, 8)) == [("a", 0, 4), ("b", 4, 8)]


def test_enters_a_server_mid_span_and_respects_speed():
    fast = record(peer_id="fast", start=2, end=8, inference_sps=1000.0)
    slow = record(peer_id="slow", start=0, end=5, inference_sps=1.0)
    route = choose_route([fast, slow], 0, 8)
    assert spans(route) == [("slow", 0, 2), ("fast", 2, 8)]
    assert spans(choose_route([fast, slow], 3, 8)) == [("fast", 3, 8)]


def test_measured_speed_replaces_a_claim():
    honest = record(peer_id="honest", start=0, end=8, inference_sps=10.0)
    boaster = record(peer_id="boaster", start=0, end=8, inference_sps=1e6)  # claims to be far faster
    assert spans(choose_route([honest, boaster], 0, 8))[0][0] == "boaster"  # unmeasured: its claim stands
    measured = {"boaster": 0.05}  # seconds per block per step, as the client saw it
    assert spans(choose_route([honest, boaster], 0, 8, measured=measured))[0][0] == "honest"
    assert spans(choose_route([honest, boaster], 0, 8, measured={"boaster": 1e-6}))[0][0] == "boaster"


def test_an_unmeasured_claim_counts_no_faster_than_the_fastest_peer_measured():
    honest = record(peer_id="honest", start=0, end=8, inference_sps=10.0)
    fresh = record(peer_id="fresh-id", start=0, end=8, inference_sps=1e12)  # a stranger under a new id
    measured = {"honest": 0.001}  # the client timed the honest peer: its real cost stands
    assert spans(choose_route([honest, fresh], 0, 8, measured=measured))[0][0] == "honest"


def test_stochastic_wiring_tries_a_replica_it_has_not_measured():
    """A replica whose claim is far slower than what the client measured of its twin is still wired micro-batches
    (priced as the fastest measured one until its own calls measure it): by its claim alone it would never be
    drawn, so never measured, and starved for good. Deterministic routing keeps believing the claim."""
    import random

    measured_twin = record(peer_id="measured", start=0, end=8, forward_tps=1.0)
    fresh = record(peer_id="fresh", start=0, end=8, forward_tps=1.0)  # the same modest claim, never timed
    measured = {"measured": 1e-5}  # what the client saw of the twin: 10,000x faster than the claims
    rng = random.Random(0)
    picks = {
        spans(
            choose_route(
                [measured_twin, fresh],
                0,
                8,
                mode="forward",
                measured=measured,
                noise={"measured": rng.expovariate(1.0), "fresh": rng.expovariate(1.0)},
            )
        )[0][0]
        for _ in range(40)
    }
    assert picks == {"measured", "fresh"}
    assert spans(choose_route([measured_twin, fresh], 0, 8, mode="forward", measured=measured))[0][0] == "measured"


def test_missing_blocks_are_named():
    with pytest.raises(MissingBlocksError) as info:
        choose_route([record(start=0, end=3), record(peer_id="b", start=5, end=8)], 0, 8, model_id="m")
    assert info.value.blocks == [3, 4]


def test_eligibility_bans_states_cache_and_fingerprints():
    recs = [
        record(peer_id="a"),
        record(peer_id="b", state=PeerState.LEAVING),
        record(peer_id="c", fingerprint="x"),
        record(peer_id="d", cache_tokens_free=5),
        record(peer_id="e"),
        record(peer_id="old", protocol_version=1),  # a peer of the previous protocol: never routed to
    ]
    view = view_of(*recs)
    names = {r.peer_id for r in eligible(view, fingerprint="fp", banned=frozenset({"e"}), min_cache_tokens=10)}
    assert names == {"a"}


def test_pick_fingerprint_prefers_full_coverage():
    view = view_of(
        record(peer_id="a", end=8, fingerprint="good", forward_tps=1),
        record(peer_id="b", end=4, fingerprint="partial", forward_tps=1e6),
    )
    assert pick_fingerprint(view) == {"good"}


def test_a_client_chains_only_the_weights_it_holds_however_fast_a_stranger_claims_to_be():
    view = view_of(
        record(peer_id="honest", end=8, fingerprint="ours", forward_tps=1),
        record(peer_id="stranger", end=8, fingerprint="theirs", forward_tps=1e12),
    )
    assert pick_fingerprint(view) == {"theirs"}  # a tool reading the swarm sees the best-covered weights
    assert pick_fingerprint(view, frozenset({"ours"})) == {"ours"}
    assert pick_fingerprint(view_of(record(peer_id="stranger", end=8, fingerprint="theirs")), frozenset({"ours"})) == {
        "ours"
    }
    assert [r.peer_id for r in eligible(view, fingerprint="ours")] == ["honest"]


def test_formats_a_client_allowed_share_a_chain_and_dtypes_never_do():
    """Blocks 0:4 exact, 4:8 only in NF4 (same dtype), 0:8 in bfloat16: a client that allowed NF4 chains the exact
    and NF4 servers (their group covers every block); one that did not sees 4:8 covered in bfloat16 only."""
    view = view_of(
        record(peer_id="exact", end=4, fingerprint="f32"),
        record(peer_id="nf4", start=4, end=8, fingerprint="f32+nf4"),
        record(peer_id="bf16", end=8, fingerprint="bf16", forward_tps=1),
    )
    groups = {"f32": "float32", "f32+nf4": "float32", "bf16": "bfloat16"}
    chosen = pick_fingerprint(view, frozenset(groups), groups)
    assert chosen == {"f32", "f32+nf4"}
    assert sorted(r.peer_id for r in eligible(view, fingerprint=chosen)) == ["exact", "nf4"]
    exact = {"f32": "float32", "bf16": "bfloat16"}
    assert pick_fingerprint(view, frozenset(exact), exact) == {"bf16"}


def test_a_moved_peer_is_known_by_its_current_record():
    from swarm.records import servers

    old = record(peer_id="m", start=0, end=4, state=PeerState.LEAVING)
    new = record(peer_id="m", start=4, end=8)
    assert servers(view_of(old, new))["m"].span == new.span
    assert servers(view_of(record(peer_id="gone", state=PeerState.LEAVING)))["gone"].state == PeerState.LEAVING


ONNX_CAPS = frozenset({Capability.INFERENCE, Capability.FORWARD})


def test_routes_that_need_a_capability_skip_servers_without_it():
    torch_a = record(peer_id="torch-a", start=0, end=4)
    onnx_b = record(peer_id="onnx-b", start=4, end=8, runtime="onnx", capabilities=ONNX_CAPS, inference_sps=1e6)
    torch_b = record(peer_id="torch-b", start=4, end=8, inference_sps=1.0)
    view = view_of(torch_a, onnx_b, torch_b)
    assert {r.peer_id for r in eligible(view, fingerprint="fp")} == {"torch-a", "onnx-b", "torch-b"}
    for needs in ({Capability.BACKWARD}, {Capability.ADAPTERS}, {Capability.FORWARD, Capability.BACKWARD}):
        names = {r.peer_id for r in eligible(view, fingerprint="fp", needs=frozenset(needs))}
        assert names == {"torch-a", "torch-b"}, needs
    assert {r.peer_id for r in eligible(view, fingerprint="fp", needs=frozenset({Capability.FORWARD}))} == {
        "torch-a",
        "onnx-b",
        "torch-b",
    }
    # a record without the fields (a peer from before runtimes were announced) is read as the torch runtime
    legacy = {k: v for k, v in torch_a.to_wire().items() if k not in ("runtime", "capabilities")}
    parsed = parse_record(legacy)
    assert parsed is not None and parsed.runtime == "torch" and parsed.capabilities == ALL_CAPABILITIES


class _Store:
    """The one call SwarmView makes of its record store, over a fixed view."""

    def __init__(self, view):
        self._view = view

    def view(self, model_id, num_blocks, enough=None):
        return self._view


def test_swarm_view_routes_by_needed_capabilities():
    from swarm.client.swarm_view import SwarmView
    from swarm.config import ClientConfig

    onnx_fast = record(
        peer_id="onnx", start=0, end=8, runtime="onnx", capabilities=ONNX_CAPS, inference_sps=1e6, forward_tps=1e6
    )
    torch_slow = record(peer_id="torch", start=0, end=8, inference_sps=1.0, forward_tps=1.0)
    sv = SwarmView(_Store(view_of(onnx_fast, torch_slow)), "m", 8, ClientConfig())
    assert spans(sv.route(0, 8)) == [("onnx", 0, 8)]  # the faster one, when nothing special is needed
    assert spans(sv.route(0, 8, mode="forward", needs=frozenset({Capability.BACKWARD}))) == [("torch", 0, 8)]
    assert {r.peer_id for r in sv.servers(needs=frozenset({Capability.ADAPTERS}))} == {"torch"}
    lone = SwarmView(_Store(view_of(onnx_fast)), "m", 8, ClientConfig())
    with pytest.raises(MissingBlocksError):  # only a server without the capability holds these blocks
        lone.route(0, 8, needs=frozenset({Capability.ADAPTERS}))


def test_a_micro_batchs_wiring_depends_on_its_key_and_seed_not_on_threads():
    """Stochastic routes drawn inside ``SwarmView.wiring(key)`` come from a generator of that key's own: the same
    picks whether the micro-batches run one after another or in threads in the opposite order (one generator shared
    by the threads would hand each the draws of whichever ran first)."""
    from concurrent.futures import ThreadPoolExecutor

    from swarm.client.swarm_view import SwarmView
    from swarm.config import ClientConfig

    fast = record(peer_id="fast", start=0, end=8, forward_tps=300.0)
    slow = record(peer_id="slow", start=0, end=8, forward_tps=100.0)

    def picks(seed: int, keys: list[int], threads: bool) -> dict[int, list[str]]:
        sv = SwarmView(_Store(view_of(fast, slow)), "m", 8, ClientConfig(wiring_seed=seed))

        def pick(key: int) -> list[str]:
            with sv.wiring(key):  # a micro-batch's first route and two repairs
                return [sv.route(0, 8, mode="forward", stochastic=True)[0].peer_id for _ in range(3)]

        if not threads:
            return {k: pick(k) for k in keys}
        with ThreadPoolExecutor(4) as pool:
            return dict(zip(keys, pool.map(pick, keys), strict=True))

    keys = list(range(40))
    alone = picks(0, keys, threads=False)
    assert picks(0, keys[::-1], threads=True) == alone
    assert {p for ps in alone.values() for p in ps} == {"fast", "slow"}  # stochastic: both replicas get work
    assert picks(1, keys, threads=False) != alone


def test_swarm_view_passes_the_models_costs_to_routing():
    """What the live client's routing receives: the calibrated software cost per hop of the call's kind, chained
    or client-mediated as the client sends, the hidden states' bytes for the call's tokens through the codec the
    transport would pick; each one changes a route when it is passed, and would not if it were dropped."""
    from swarm.client.swarm_view import SwarmView
    from swarm.config import ClientConfig
    from swarm.perf.model import Software

    sw = Software(step_hop=0.006, step_hop_chained=0.004, call_hop=0.005)

    def view(*recs, cfg=None, software=sw, hidden=8192):
        cfg = cfg or ClientConfig()
        return SwarmView(_Store(view_of(*recs)), "m", 8, cfg, hidden=hidden, value_bytes=4, software=software)

    costs = view().costs("inference")
    assert (costs.software, costs.chained, costs.token_bytes, costs.tokens) == (0.004, True, 8192 * 4, 1)
    mediated = view(cfg=ClientConfig(chain=False)).costs("inference", 3)
    assert (mediated.software, mediated.chained, mediated.tokens) == (0.006, False, 3)
    forward = view(cfg=ClientConfig(chain=True)).costs("forward", 512)
    assert (forward.software, forward.chained, forward.tokens) == (0.005, False, 512)  # forwards are not chained
    assert view(software=None).costs("inference").software == 0.0  # never calibrated: the flat prior alone

    # the codec: exact where the link is unknown or fast enough, block8 on a slow one (auto), or the forced one
    v = view()
    assert v.wire(4e6, None) == 4e6 and v.wire(1000.0, 10.0) == 1000.0  # a small message is sent as is
    assert v.wire(4e6, 10.0) == pytest.approx(4e6 * (1 + 9 / 128) / 4)
    assert view(cfg=ClientConfig(codec="float16")).wire(4e6, None) == pytest.approx(2e6)

    # bytes and tokens: a 10 Mbit/s link that is 4x faster at compute wins a decode step, loses a 512-token forward
    thin = record(peer_id="thin", start=0, end=8, inference_sps=20.0, forward_tps=2000.0, network_mbps=10.0)
    wide = record(peer_id="wide", start=0, end=8, inference_sps=5.0, forward_tps=500.0, network_mbps=1000.0)
    assert spans(view(wide, thin).route(0, 8))[0][0] == "thin"
    assert spans(view(thin, wide).route(0, 8, mode="forward", tokens=512))[0][0] == "wide"
    assert spans(view(thin, wide, hidden=0).route(0, 8, mode="forward", tokens=512))[0][0] == "thin"  # not priced

    # the software cost per hop: two fast half-spans against one slower whole one
    a = record(peer_id="a", start=0, end=4, inference_sps=80.0)
    b = record(peer_id="b", start=4, end=8, inference_sps=80.0)
    whole = record(peer_id="whole", start=0, end=8, inference_sps=24.0)
    assert [p for p, *_ in spans(view(whole, a, b, software=None).route(0, 8))] == ["a", "b"]
    costly = Software(step_hop_chained=0.05)
    assert [p for p, *_ in spans(view(whole, a, b, software=costly).route(0, 8))] == ["whole"]


def test_new_sessions_spread_over_replicas_by_their_load():
    """32 sessions over 4 replicas of a span, one client: each new session counts where the earlier ones went, so they
    spread within 20% of even although one replica was measured 10% faster; a server announcing more open sessions
    (other clients') gets fewer; forwards are not priced by sessions."""
    from swarm.client.session.routes import SessionRoutes
    from swarm.client.swarm_view import SwarmView
    from swarm.config import ClientConfig

    replicas = [record(peer_id=f"r{i}", start=0, end=8) for i in range(4)]
    sv = SwarmView(_Store(view_of(*replicas)), "m", 8, ClientConfig())
    sv.speeds[("r0", "inference")] = 0.9 / (10.0 * 8)  # measured a little faster than it claims
    for r in replicas[1:]:
        sv.speeds[(r.peer_id, "inference")] = 1.0 / (10.0 * 8)

    class Conn:
        view, trust = sv, None

    routes = SessionRoutes(Conn(), 1, 16, frozenset(), "s")  # a view (and no trust) is all ``new`` reads
    counts = Counter(routes.new(0, 8)[0].peer_id for _ in range(32))
    assert set(counts) == {"r0", "r1", "r2", "r3"} and max(counts.values()) <= 8 * 1.2
    routes.release([h for peer, n in counts.items() for h in [Hop(peer, 0, 8)] * n])
    assert not sv.sessions_here  # every session let go: nothing counted
    busy = [record(peer_id="r0", start=0, end=8, open_sessions=20), record(peer_id="r1", start=0, end=8)]
    sv = SwarmView(_Store(view_of(*busy)), "m", 8, ClientConfig())
    assert [h.peer_id for h in sv.route(0, 8)] == ["r1"]  # claimed speeds equal: the idle one
    assert len(sv.route(0, 8, mode="forward")) == 1  # a forward is priced by speed alone
