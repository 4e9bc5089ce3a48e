"""Bounded resources per caller and in total, without a swarm: quotas, the KV share, kept-graph bytes, the adapter
cache's callers and pins, the compute queue, degenerate tensors, and stream time limits. Time limits are tested with
streams that never send (so the outcome, not a duration, is asserted)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import msgpack
import pytest
import torch

from peers.serving.activations import ActivationStore, Kept, SavedBytes
from peers.serving.adapters import AdapterCache, parse_adapter
from peers.serving.checks import Limits, check_aux, check_finite, check_hidden
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget
from peers.serving.limits import ANONYMOUS, GuardedFrames, Quota, StreamIdle, StreamStalled, caller_of
from peers.serving.sessions import SessionTable
from swarm import wire
from swarm.config import Timing
from swarm.errors import AdapterMissingError, BadInputError, BusyError
from swarm.ids import Span
from swarm.protocol import AdapterRef, OpenSession
from swarm.records import ALL_CAPABILITIES

ATTACKERS = [f"attacker-{i}" for i in range(50)]


def test_quota_per_caller_and_in_total_against_many_identities():
    quota = Quota("open sessions", per_caller=2, total=20, flags=("--max-caller-sessions", "--max-sessions"))
    quota.acquire("me")
    quota.acquire("me")
    with pytest.raises(BusyError, match=r"this caller holds 2 of its limit of 2.*--max-caller-sessions"):
        quota.acquire("me")
    refused = 0
    for caller in ATTACKERS:
        for _ in range(2):
            try:
                quota.acquire(caller)
            except BusyError as e:
                assert "--max-sessions" in str(e)
                refused += 1
    assert quota.used == 20 and refused == 100 - 18
    quota.release("me")
    quota.acquire(ATTACKERS[-1])  # the room one gave back
    with pytest.raises(BusyError):
        quota.acquire("newcomer")


def test_caller_of_context():
    class Id:
        def to_base58(self) -> str:
            return "12D3Koo"

    assert caller_of(SimpleNamespace(remote_id=Id())) == "12D3Koo"
    assert caller_of(None) == ANONYMOUS


async def test_cache_budget_share_per_caller():
    budget = CacheBudget(100, per_caller=50)
    await budget.reserve(40, 0.05, "me")
    with pytest.raises(BusyError, match="holds 40 bytes of 50 bytes"):
        await budget.reserve(20, 0.05, "me")
    await budget.reserve(50, 0.05, "other")
    await budget.release(40, "me")
    assert await budget.reserve(50, 0.05, "me") == 50 and budget.free == 0


def _serving_engine() -> Engine:
    """An engine serving blocks 0:2 through a runtime that runs nothing (sessions open and end, no step runs)."""
    engine = _engine()
    runtime = SimpleNamespace(
        span=Span(0, 2), new_cache=lambda max_length=None: None, name="torch", capabilities=ALL_CAPABILITIES
    )
    engine.loaded.set(runtime)
    engine.loaded.serving = True
    return engine


async def test_sessions_capped_per_caller_and_in_total_with_50_identities():
    quota = Quota("open sessions", per_caller=2, total=10, flags=("--max-caller-sessions", "--max-sessions"))
    budget = CacheBudget(10_000, per_caller=5_000)
    sessions = SessionTable(_serving_engine(), budget, cache_wait=0.05, quota=quota)

    def msg(i: int) -> OpenSession:
        return OpenSession(session_id=f"{i:032d}", start=0, end=1, max_length=10, batch_size=1)

    opened, refused = [], 0
    for i, caller in enumerate(ATTACKERS * 2):
        try:
            opened.append(await sessions.start(msg(i), {}, caller))
        except BusyError:
            refused += 1
    assert len(sessions.open) == 10 and refused == 90 and budget.used == 100
    # the same session id from another caller is another session (nobody can squat a client's id)
    await sessions.end(opened[0])
    again = await sessions.start(msg(1), {}, "someone-else")
    assert again.caller == "someone-else" and budget.used == 100 and quota.used == 10
    for session in [*opened[1:], again]:
        await sessions.end(session)
    assert budget.used == 0 and quota.used == 0 and not budget.held


def test_kept_graphs_bounded_in_bytes_per_caller_and_in_total():
    store = ActivationStore(max_bytes=100, max_bytes_per_caller=60, ttl=100.0)
    t = torch.zeros(1)
    released = []

    def kept(nbytes: int) -> Kept:
        pin = SimpleNamespace(release=lambda: released.append(nbytes))
        return Kept(t, t, Span(0, 1), nbytes=nbytes, pin=pin)  # type: ignore[arg-type]

    assert store.put("a", "1", kept(30)) and store.put("a", "2", kept(30))
    assert store.put("a", "3", kept(30))  # over its share: its own oldest goes
    assert store.pop("a", "1") is None and store.bytes_of("a") == 60 and released == [30]
    assert not store.put("a", "big", kept(61))  # larger than a caller's share: never kept
    assert store.put("b", "1", kept(40))
    assert not store.put("c", "1", kept(10))  # the total is full of others' graphs: not kept, nobody evicted
    assert store.nbytes == 100 and store.bytes_of("a") == 60 and store.bytes_of("b") == 40
    assert store.pop("b", "2") is None and store.pop("c", "1") is None
    assert store.pop("a", "2") is not None  # another caller cannot pop it with the same forward id
    assert store.pop("b", "1") is not None and store.nbytes == 30
    # 50 identities together stay under the total
    for caller in ATTACKERS:
        store.put(caller, "x", kept(20))
    assert store.nbytes <= 100


def test_saved_bytes_counts_what_autograd_saves_once_and_not_the_weights():
    weight = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    saved = SavedBytes({weight.untyped_storage().data_ptr()})
    with saved.measuring():
        h = torch.tanh(x @ weight)  # the matmul saves the weight (excluded), tanh its output h
        (h * h).sum()  # saves h twice more: counted once
        (x * 2.0).exp()  # exp saves its output: a new storage
    assert saved.nbytes == 2 * 4 * 8 * 4


def _adapter(rank: int = 2):
    linears = {"q": (8, 8)}
    tensors = {"lora.0.q.A": torch.zeros(rank, 8), "lora.0.q.B": torch.zeros(8, rank)}
    return parse_adapter(tensors, Span(0, 1), linears, 8, torch.float32, 1.0)  # 2 * rank * 8 * 4 bytes


def _ref(client: str, version: int = 1) -> AdapterRef:
    return AdapterRef(client=client * 64, version=version, has_tensors=True)


def test_adapter_cache_callers_pins_and_refusals():
    cache = AdapterCache(max_bytes=1024, ttl=100.0, per_caller=512)  # rank 2: 128 B; rank 8: 512 B
    sub = Span(0, 1)
    with pytest.raises(BadInputError, match="--max-caller-adapter-mb"):
        cache.put("me", _ref("a"), _adapter(rank=9), sub)
    _, pin_a = cache.put("me", _ref("a"), _adapter(rank=4), sub)  # pinned, as by an open session
    with pytest.raises(BusyError, match="this caller's adapters in use"):
        cache.put("me", _ref("b"), _adapter(rank=8), sub)
    # a new version while the old one is in use: the old one still counts until its holder lets go
    _, pin_a2 = cache.put("me", _ref("a", 2), _adapter(rank=4), sub)
    assert cache.bytes_of("me") == 256 + 256
    pin_a.release()
    pin_a.release()  # idempotent
    assert cache.bytes_of("me") == 256
    pin_a2.release()
    # other callers fill the rest, unpinned; then a pinned one from someone
    for caller in ("x", "y", "z"):
        cache.put(caller, _ref("c"), _adapter(rank=4), sub)[1].release()
    assert cache.nbytes == 1024
    cache.put("new", _ref("d"), _adapter(), sub)[1].release()  # evicts only the least recently used
    assert len(cache) == 4 and cache.nbytes == 768 + 128
    with pytest.raises(AdapterMissingError):
        cache.get("me", _ref("a", 2), sub)
    _, held = cache.get("x", _ref("c"), sub)
    for caller in ("y", "z", "new"):  # pin every entry: no room can be made
        cache.get(caller, _ref("d" if caller == "new" else "c"), sub)
    with pytest.raises(BusyError, match="held by adapters in use"):
        cache.put("late", _ref("e"), _adapter(rank=8), sub)
    assert len(cache) == 4  # refused without evicting anyone
    # 50 identities uploading at once stay under the total
    held.release()
    for caller in ATTACKERS:
        try:
            cache.put(caller, _ref("f"), _adapter(), sub)
        except BusyError:
            pass
    assert cache.nbytes <= 1024


def _engine(**cfg: int) -> Engine:
    return Engine(Limits(8, torch.float32, 2, 64), ComputeConfig(**cfg), Timing())


async def test_compute_queue_capped_per_caller_and_in_total():
    service = _engine(max_queued=3, max_caller_queued=1)
    gate = threading.Event()
    try:
        first = asyncio.ensure_future(service.run(gate.wait, 5.0, caller="a"))
        await asyncio.sleep(0)
        with pytest.raises(BusyError, match="--max-caller-queued"):
            await service.run(lambda: None, caller="a")
        waiting = [asyncio.ensure_future(service.run(lambda: 1, caller=c)) for c in ("b", "c")]
        await asyncio.sleep(0)
        refused = 0
        for caller in ATTACKERS:
            try:
                await service.run(lambda: None, caller=caller)
            except BusyError as e:
                assert "--max-queued" in str(e)
                refused += 1
        assert refused == 50
        own = asyncio.ensure_future(service.run(lambda: 2))  # the server's own work is not a client's queue...
        await asyncio.sleep(0)  # ...so it was not refused (that would end it now), and runs once the gate opens
        gate.set()
        await first
        assert await own == 2
        assert await asyncio.gather(*waiting) == [1, 1] and service.queued.used == 0
    finally:
        gate.set()
        service.close()


def test_degenerate_tensors_are_refused():
    limits = Limits(8, torch.float32, 2, 64, max_positions=16)
    for shape, message in (((0, 4, 8), "empty batch"), ((2, 0, 8), "no tokens")):
        with pytest.raises(BadInputError, match=message):
            check_hidden({"hidden": torch.zeros(shape)}, limits)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(BadInputError, match="NaN or infinite"):
            check_finite(torch.tensor([[[0.0, bad]]]), "grad_output")
    ones = torch.ones(1, 3, dtype=torch.int64)
    with pytest.raises(BadInputError, match="only 0 and 1"):
        check_aux({"attention_mask": ones * 2}, 1, 3, 3, limits)
    with pytest.raises(BadInputError, match=r"lie in \[0, 16\)"):
        check_aux({"position_ids": torch.tensor([[0, 1, 16]])}, 1, 3, 3, limits)
    with pytest.raises(BadInputError, match="lie in"):
        check_aux({"position_ids": torch.tensor([[-1, 0, 1]])}, 1, 3, 3, limits)
    mask, pos = check_aux({"attention_mask": ones, "position_ids": torch.tensor([[13, 14, 15]])}, 1, 3, 3, limits)
    assert mask is not None and pos is not None


class _Frames:
    """A stream that sends ``frames`` and then nothing, ever (until cancelled)."""

    def __init__(self, frames: list[wire.Frame]) -> None:
        self.frames = list(frames)

    def __aiter__(self) -> _Frames:
        return self

    async def __anext__(self) -> wire.Frame:
        if self.frames:
            return self.frames.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_stream_idle_between_messages():
    decoder = wire.Decoder()
    message = wire.encode({"kind": "x"}, {"t": torch.ones(2)})
    guarded = GuardedFrames(_Frames(message), decoder, idle=0.05, read=60.0)
    meta, tensors = await wire.read_message(guarded, decoder)  # a message that arrives is read as usual
    assert meta["kind"] == "x" and torch.equal(tensors["t"], torch.ones(2))
    with pytest.raises(StreamIdle, match="idle for 0.05 s"):
        await wire.read_message(guarded, decoder)


async def test_stream_stalled_mid_message():
    decoder = wire.Decoder()
    first = wire.Frame(metadata=msgpack.packb({"_tensors": ["t"]}))  # names a tensor that never comes
    guarded = GuardedFrames(_Frames([first]), decoder, idle=60.0, read=0.05)
    with pytest.raises(StreamStalled, match="did not complete within 0.05 s"):
        await wire.read_message(guarded, decoder)


async def test_stream_that_ends_ends_cleanly():
    async def two():
        for frame in wire.encode({"kind": "y"}):
            yield frame

    decoder = wire.Decoder()
    guarded = GuardedFrames(two(), decoder, idle=60.0, read=60.0)
    assert (await wire.read_message(guarded, decoder))[0]["kind"] == "y"
    assert await wire.read_message(guarded, decoder) is None
