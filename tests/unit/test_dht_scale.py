"""One record per server (issue 56, item 2): the per-block view rebuilt from it is the view of the layout before
(every record under each block of its span), a moved server counts only where it is now, forged, unsigned and
misplaced records are still dropped, the wire form is compact and round-trips, and the broker names only moves."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from peers.broker.loop import plan_once
from peers.broker.planner import PeerInfo, Placement, PlacementPlan, Role
from swarm.config import Timing
from swarm.dht import RecordStore, dht_time, start_dht
from swarm.dht_io import Entries
from swarm.identity import owner_of
from swarm.ids import SHARDS, Span, shard_of
from swarm.records import PeerRecord, PeerState, ServerRecord, View, parse_as

BLOCKS = 8


def _identity() -> tuple[RSAPrivateKey, bytes, str]:
    key = RSAPrivateKey()
    subkey = RSASignatureValidator(key).local_public_key
    peer_id = owner_of(subkey)
    assert peer_id is not None
    return key, subkey, peer_id


def _record(peer_id: str, start: int, end: int, state: PeerState = PeerState.ONLINE) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id,
        state=state,
        start=start,
        end=end,
        model_id="m",
        num_blocks=BLOCKS,
        fingerprint="f" * 64,
        dtype="float32",
        device="cpu",
        forward_tps=10.0,
        inference_sps=5.0,
        software_version="0",
        protocol_version=1,
    )


def _per_block_of_old(records: list[ServerRecord]) -> dict[int, set[tuple[str, int, int, str]]]:
    """The view as the layout before kept it: each record under every block of its span."""
    return {b: {(r.peer_id, r.start, r.end, r.state.value) for r in records if b in r.span} for b in range(BLOCKS)}


def _as_sets(view: View) -> dict[int, set[tuple[str, int, int, str]]]:
    return {b: {(r.peer_id, r.start, r.end, r.state.value) for r in rs} for b, rs in view.items()}


def _bare_store() -> RecordStore:
    """A store for its reading logic only (``_servers`` never touches the DHT)."""
    key = RSAPrivateKey()
    return RecordStore(None, key, RSASignatureValidator(key), 1.0)  # type: ignore[arg-type]


def test_one_record_per_server_is_read_back() -> None:
    people = [_identity() for _ in range(4)]
    spans = [(0, 3), (2, 6), (5, 8), (0, 8)]
    records = [_record(pid, s, e) for (_, _, pid), (s, e) in zip(people, spans, strict=True)]
    found: dict[int, Entries] = {}
    for (_, subkey, pid), r in zip(people, records, strict=True):
        found.setdefault(shard_of(pid), {})[subkey] = (r.to_wire(), dht_time() + 30)
    store = _bare_store()
    assert sorted(store._servers("m", found), key=records.index) == records
    assert not store.dropped


def test_forged_unsigned_and_misplaced_records_are_dropped() -> None:
    (_, honest_sub, honest), (_, liar_sub, _) = _identity(), _identity()
    good = _record(honest, 0, 4)
    forged = _record(honest, 4, 8)  # in the liar's subkey, in the honest peer's name
    wrong_shard = (shard_of(honest) + 1) % SHARDS
    found: dict[int, Entries] = {
        shard_of(honest): {honest_sub: (good.to_wire(), 1e12), liar_sub: (forged.to_wire(), 1e12)},
        wrong_shard: {honest_sub: (_record(honest, 0, 8).to_wire(), 1e12)},  # not where ``announce`` puts it
    }
    found[shard_of(honest)][b"unsigned"] = (_record(honest, 0, 8).to_wire(), 1e12)
    store = _bare_store()
    assert store._servers("m", found) == [good]
    assert store.dropped == {"foreign": 1, "unsigned": 1, "misplaced": 1}


def test_the_wire_form_is_compact_and_round_trips() -> None:
    record = _record(_identity()[2], 1, 5)
    wire = record.to_wire()
    assert wire["schema_version"] == record.schema_version  # kept though it is a default
    assert "open_sessions" not in wire and "maddrs" not in wire  # defaults left out
    assert parse_as(ServerRecord, wire) == record
    assert len(str(wire)) < len(str(record.model_dump(mode="json")))
    assert parse_as(ServerRecord, {k: v for k, v in wire.items() if k != "schema_version"}) is None


class _Heartbeats:
    """The peers key as the broker reads it (the DHT is not what this test is about)."""

    def __init__(self, records: list[PeerRecord]) -> None:
        self.records = records

    def heartbeats(self, model_id: str) -> list[PeerRecord]:
        return self.records


def test_the_broker_names_only_the_peers_that_must_move() -> None:
    now = dht_time()
    beat = dict(block_throughput=1.0, memory=8, max_blocks=8, updated_at=now)
    stays = PeerRecord(peer_id="stays", state=PeerState.ONLINE, start=0, end=8, **beat)
    fresh = PeerRecord(peer_id="new", state=PeerState.JOINING, **beat)
    plan = PlacementPlan({"stays": Placement(Span(0, 8), Role.SERVE), "new": Placement(Span(0, 8), Role.STANDBY)})
    seen: list[list[PeerInfo]] = []

    def planner(peers: list[PeerInfo]) -> PlacementPlan:
        seen.append(peers)
        return plan

    assignment = plan_once(_Heartbeats([stays, fresh]), "m", planner, "b", 1, Timing())  # type: ignore[arg-type]
    assert {p.peer_id for p in seen[0]} == {"stays", "new"}  # every live peer is planned
    assert set(assignment.placements) == {"new"}  # the one already where the plan puts it is not named


@pytest.fixture
def dht_stores() -> Iterator[list[RecordStore]]:
    first = start_dht()
    stores = [first]
    try:
        peers = tuple(first.visible_maddrs())
        stores.append(start_dht(initial_peers=peers))
        stores.append(start_dht(initial_peers=peers, client_mode=True))
        yield stores
    finally:
        for s in stores:
            s.shutdown()


def test_a_real_dht_keeps_one_record_per_server(dht_stores: list[RecordStore]) -> None:
    a, b, client = dht_stores
    expiration = dht_time() + 60
    assert a.announce(_record(a.peer_id, 0, 3), expiration)
    assert b.announce(_record(b.peer_id, 2, 6), expiration)
    view = client.view("m", BLOCKS)
    assert _as_sets(view) == _per_block_of_old([_record(a.peer_id, 0, 3), _record(b.peer_id, 2, 6)])
    # a moves (make before break: the new record, then ``peers.node``'s leaving record for what it dropped)
    assert a.announce(_record(a.peer_id, 3, 6), expiration + 1)
    assert a.announce(_record(a.peer_id, 0, 3, PeerState.LEAVING), expiration + 1)
    moved = [_record(a.peer_id, 3, 6), _record(b.peer_id, 2, 6)]
    assert _as_sets(client.view("m", BLOCKS)) == _per_block_of_old(moved)
    # a sample: reading stops once every block has one online server, and never misses a served block
    sample = client.view("m", BLOCKS, enough=1)
    assert all(sample[blk] for blk in range(2, 6)) and not any(sample[blk] for blk in itertools.chain(range(2), [6, 7]))
    # a leaves: its leaving record of the span it holds is stored
    assert a.announce(_record(a.peer_id, 3, 6, PeerState.LEAVING), expiration + 2)
    left = [_record(a.peer_id, 3, 6, PeerState.LEAVING), _record(b.peer_id, 2, 6)]
    assert _as_sets(client.view("m", BLOCKS)) == _per_block_of_old(left)
    # heartbeats go to their author's shard of the peers keys, and the broker reads them all back
    now = dht_time()
    for store in (a, b):
        beat = PeerRecord(
            peer_id=store.peer_id, state=PeerState.ONLINE, block_throughput=1.0, memory=8, max_blocks=8, updated_at=now
        )
        assert store.heartbeat("m", beat, expiration)
    assert {r.peer_id for r in client.heartbeats("m")} == {a.peer_id, b.peer_id}
    assert not client.dropped
