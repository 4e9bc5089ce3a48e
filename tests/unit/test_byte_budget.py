"""What a server holds for others, counted per caller and in total (``wire.ByteBudget``), a session's room in it
(``wire.SessionRoom``), the budgets one ``--max-memory-mb`` sets, and whom chaining trusts (``ServerDirectory``)."""

from __future__ import annotations

import asyncio

import pytest

from peers.rpc.directory import ServerDirectory
from peers.serving.config import MIB, ComputeConfig, within_memory
from swarm import wire
from swarm.errors import BusyError
from swarm.ids import shard_of
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import PeerState, ServerRecord


def test_a_caller_is_bounded_alone_and_all_together() -> None:
    budget = wire.ByteBudget(100, per_caller=60)
    budget.take(60, "a")
    with pytest.raises(BusyError):
        budget.take(1, "a")  # its own share is full
    budget.take(40, "b")
    with pytest.raises(BusyError):
        budget.take(1, "c")  # a newcomer, with the total reached
    assert budget.refused == 2 and budget.used == 100
    budget.hold(10, "c")  # a reply that exists already is counted, never refused
    assert budget.used == 110 and budget.by_caller["c"] == 10
    for caller, n in (("a", 60), ("b", 40), ("c", 10)):
        budget.give(n, caller)
    assert budget.used == 0 and budget.by_caller == {}  # a caller holding nothing costs nothing


def test_a_session_keeps_its_room_when_others_fill_the_budget() -> None:
    budget = wire.ByteBudget(100, per_caller=100)
    room = wire.SessionRoom(budget, "honest", 20)
    budget.take(80, "sybil")  # the rest of the budget, taken after the session opened
    with pytest.raises(BusyError):
        budget.take(1, "newcomer")
    room.take(15)  # its steps still fit
    room.give(15)
    with pytest.raises(BusyError):
        room.take(25)  # beyond its room it competes like anyone
    assert room.used == 0 and room.over == 0
    budget.give(80, "sybil")
    room.take(25)  # 20 from the room, 5 from the budget
    assert (room.used, room.over, budget.used) == (20, 5, 25)
    room.give(25)
    room.close()
    assert budget.used == 0 and budget.by_caller == {}


def test_one_ceiling_sets_every_budget_and_keeps_one_request_fitting() -> None:
    c = within_memory(ComputeConfig(max_memory_bytes=256 * MIB))
    parts = c.max_held_bytes + c.max_kept_bytes + c.max_adapter_bytes + (c.cache_bytes or 0)
    assert parts == 256 * MIB
    assert c.max_caller_held_bytes <= c.max_held_bytes and c.max_message_bytes <= c.max_caller_held_bytes
    assert c.max_caller_kept_bytes <= c.max_kept_bytes and c.max_caller_adapter_bytes <= c.max_adapter_bytes
    assert within_memory(ComputeConfig()) == ComputeConfig()  # no ceiling: nothing changes


def _record(
    peer: str, start: int, end: int, fingerprint: str = "fp", state: PeerState = PeerState.ONLINE
) -> ServerRecord:
    return ServerRecord(
        peer_id=peer,
        state=state,
        start=start,
        end=end,
        model_id="m",
        num_blocks=4,
        fingerprint=fingerprint,
        dtype="float32",
        device="cpu",
        forward_tps=1.0,
        inference_sps=1.0,
        software_version="0",
        protocol_version=PROTOCOL_VERSION,
    )


def test_chaining_trusts_only_servers_of_the_block_with_our_weights() -> None:
    now = [0.0]
    reads: list[int] = []
    peers = ("b", "other-weights", "standby", "stranger", "late")
    records: dict[int, list[ServerRecord]] = {}
    for r in (
        _record("b", 0, 2),
        _record("other-weights", 0, 2, "xx"),
        _record("standby", 1, 2, state=PeerState.STANDBY),
    ):
        records.setdefault(shard_of(r.peer_id), []).append(r)

    def read(shard: int) -> list[ServerRecord]:
        reads.append(shard)
        return records.get(shard, [])

    directory = ServerDirectory(read, frozenset({"fp"}), 4, ttl=8.0, clock=lambda: now[0])
    shards = {p: shard_of(p) for p in peers}

    async def scenario() -> None:
        assert (await directory.server_at("b", 1)) is not None
        assert (await directory.server_at("b", 2)) is None  # not a block of its span
        for peer in ("other-weights", "standby", "stranger"):
            assert (await directory.server_at(peer, 1)) is None
        # one read a shard served them all: a flood of unknown names costs one read per shard and period
        assert sorted(reads) == sorted({shards[p] for p in ("b", "other-weights", "standby", "stranger")})
        seen = len(reads)
        assert (await directory.server_at("b", 7)) is None and len(reads) == seen  # no such block: no read
        now[0] = 3.0
        records.setdefault(shards["late"], []).append(_record("late", 1, 3))
        assert (await directory.server_at("late", 1)) is not None  # a server that just joined is found
        assert reads[-1] == shards["late"] and len(reads) == seen + 1

    asyncio.run(scenario())


def test_a_compressed_message_is_charged_its_decoded_size_before_it_is_decoded() -> None:
    """A block8 activation decodes to about 4x its wire size: the decoder charges the caller for the decoded bytes
    before allocating them, so a message under the caller's share on the wire but over it decoded is refused
    (``busy``) with nothing allocated, and one within is held at its decoded size until released."""
    import torch

    from swarm.codecs import Codec

    hidden = torch.randn(1, 256, 256, generator=torch.Generator().manual_seed(0))  # 256 KiB decoded
    frames = wire.encode({"x": 1}, {"hidden": hidden}, Codec.block8)
    on_wire = wire.encoded_size(frames)
    assert on_wire < 100_000  # about a quarter
    budget = wire.ByteBudget(1 << 30, per_caller=150_000)
    decoder = wire.Decoder(1 << 20, budget, "c")
    with pytest.raises(BusyError, match="this caller holds"):
        for frame in frames:
            decoder.feed(frame)
    decoder.release()
    assert budget.used == 0
    budget = wire.ByteBudget(1 << 30, per_caller=1 << 20)
    decoder = wire.Decoder(1 << 20, budget, "c")
    message = None
    for frame in frames:
        message = decoder.feed(frame) or message
    assert message is not None and message[1]["hidden"].shape == hidden.shape
    assert budget.by_caller["c"] == hidden.numel() * 4  # the decoded size, not the wire's
    decoder.release()
    assert budget.used == 0
