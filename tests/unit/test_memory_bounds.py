"""What a server drops is freed at once, by reference counting, not at some later full garbage collection: kept
forward graphs the store lets go (over a cap, expired, or popped) and the partial message of a stream that stalled,
broke or ended mid-message. Each test runs with the cyclic garbage collector disabled and asserts, with weak
references, that nothing it dropped is still alive: a reference cycle anywhere on those paths fails it."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from peers.rpc.assembly import assemble
from peers.rpc.chain import StepPusher
from peers.rpc.directory import ServerDirectory
from peers.rpc.edge import Edge
from peers.rpc.servicer import Servicer
from peers.serving.activations import ActivationStore, Kept, SavedBytes, storages
from peers.serving.checks import Limits
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.pass_service import PassService
from swarm import wire
from swarm.config import Timing
from swarm.ids import Span
from swarm.protocol import PROTOCOL_VERSION


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()  # start clean: what is alive afterwards was kept by the code under test
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- kept forward graphs -------------------------------------------------------------------------------------------
WEIGHT = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))


class _Tracking(SavedBytes):
    """Measures as the server does, and keeps a weak reference to every tensor autograd saved."""

    def __init__(self, exclude: set[int], refs: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__(exclude)
        self.refs = refs

    def add(self, t: torch.Tensor) -> None:
        if t.untyped_storage().data_ptr() not in self.exclude:
            self.refs.append(weakref.ref(t))
        super().add(t)


def _kept(refs: list[weakref.ref[torch.Tensor]], weight: torch.Tensor = WEIGHT) -> Kept:
    """A forward kept as ``PassService._forward_kept`` keeps it: tanh and exp save their own outputs, the ops
    whose saved tensors made a cycle through their ``grad_fn``."""
    saved = _Tracking(storages([weight]), refs)
    with torch.enable_grad(), saved.measuring():
        inputs = torch.randn(4, 64).requires_grad_(True)
        outputs = torch.tanh(inputs @ weight).exp()
    saved.add(inputs)
    saved.add(outputs)
    return Kept(inputs, outputs, Span(0, 1), saved.nbytes)


def _alive(refs: list[weakref.ref[torch.Tensor]]) -> int:
    return sum(r() is not None for r in refs)


def test_dropped_kept_graphs_are_freed_at_once():
    with no_cyclic_gc():
        now = [0.0]
        one = _kept([]).nbytes  # 3 x [4, 64] float32: inputs, tanh's output, the output
        store = ActivationStore(max_bytes=8 * one, max_bytes_per_caller=3 * one, ttl=10.0, clock=lambda: now[0])
        evicted: list[weakref.ref[torch.Tensor]] = []
        for i in range(20):  # one caller over its share: its oldest go
            assert store.put("a", str(i), _kept(evicted if i < 17 else []))
        assert _alive(evicted) == 0 and len(store) == 3
        for caller in ("b", "c"):
            for i in range(3):
                store.put(caller, str(i), _kept([]))
        refused: list[weakref.ref[torch.Tensor]] = []
        for i in range(10):  # the total is full: not kept at all
            assert not store.put(f"x{i}", "0", _kept(refused))
        assert refused and _alive(refused) == 0
        expired: list[weakref.ref[torch.Tensor]] = []
        store.put("d", "old", _kept(expired))  # (the total evicts nobody: "d" is refused, which drops it too)
        now[0] = 100.0  # everything expires at the next use of the store
        store.put("e", "new", _kept([]))
        assert _alive(expired) == 0 and len(store) == 1
        popped: list[weakref.ref[torch.Tensor]] = []
        store.put("f", "1", _kept(popped))
        held = store.pop("f", "1")  # the backward's now; then never run (the caller went away)
        assert held is not None and _alive(popped) == 3
        del held
        assert _alive(popped) == 0


def test_kept_graphs_give_exact_gradients_and_see_the_weights_change():
    weight = WEIGHT.clone().requires_grad_(True)
    kept = _kept([], weight)
    grad = torch.randn_like(kept.outputs)
    (got,) = torch.autograd.grad(kept.outputs, kept.inputs, grad, retain_graph=True)
    x = kept.inputs.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(torch.tanh(x @ weight).exp(), x, grad)
    assert torch.equal(got, want)
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step between the forward and its backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # ``_backward`` then says: recompute
        torch.autograd.grad(kept.outputs, kept.inputs, grad)


# ---- partial messages ----------------------------------------------------------------------------------------------
class _Stream:
    """Sends ``frames``, then: stalls forever (``stall``), breaks (``reset``) or ends (``end``)."""

    def __init__(self, frames: list[wire.Frame], then: str) -> None:
        self.frames, self.then = frames, then

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> wire.Frame:
        if self.frames:
            return self.frames.pop(0)
        if self.then == "reset":
            raise ConnectionResetError("the peer went away")
        if self.then == "end":
            raise StopAsyncIteration
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def _opening() -> dict[str, object]:
    session = {"session_id": "s", "start": 0, "end": 1, "max_length": 8, "batch_size": 1}
    return {"protocol_version": PROTOCOL_VERSION, "open": session}


def _partial(meta: dict[str, object], before: list[wire.Frame] | None = None) -> list[wire.Frame]:
    """``before``, then the first two frames of a message of 12 MiB: it never completes."""
    return [*(before or []), *wire.encode(meta, {"hidden": torch.ones(1, 3 << 18, 4)})[:2]]


HANDLERS = {  # handler -> the frames it gets
    "forward_stream": lambda: _partial({"kind": "forward"}),
    "compute_loop": lambda: _partial({"kind": "forward"}),
    "bandwidth": lambda: _partial({}),
    "inference_opening": lambda: _partial(_opening()),
    "inference_step": lambda: _partial({"protocol_version": PROTOCOL_VERSION}, wire.encode(_opening())),
    "push": lambda: _partial({}),
}


def _server(timing: Timing) -> tuple[Engine, Servicer, StepPusher, list[weakref.ref[wire.Decoder]]]:
    """A server's RPC handlers over an engine without a model (sessions open as fakes), every decoder they make
    tracked."""
    engine = Engine(Limits(8, torch.float32, 2, 64), ComputeConfig(), timing)
    decoders: list[weakref.ref[wire.Decoder]] = []
    make = engine.metrics.decoder

    def tracked(max_bytes: int, budget: wire.ByteBudget | None, caller: str = "anonymous") -> wire.Decoder:
        decoder = make(max_bytes, budget, caller)
        decoders.append(weakref.ref(decoder))
        return decoder

    async def start(*_: object) -> SimpleNamespace:
        return SimpleNamespace(id="s", caller="c", sub=Span(0, 1), inbox=asyncio.Queue(), room=None)

    async def end(_: object) -> None:
        return None

    engine.metrics.decoder = tracked
    sessions = SimpleNamespace(start=start, end=end, open={})
    edge = Edge(engine.metrics, timing, max_bytes=1 << 30)
    servicer = assemble(edge, engine.limits, PassService(engine, ComputeConfig(), timing), sessions, lambda: None)
    directory = ServerDirectory(lambda _: [], frozenset({"fingerprint"}), 2, 1.0)
    pusher = StepPusher(SimpleNamespace(creds=SimpleNamespace(peer_id="me")), sessions, directory, edge)
    return engine, servicer, pusher, decoders


@contextmanager
def no_log_records() -> Iterator[None]:
    """pytest's log capture keeps every record, and a record keeps its exception (an argument, or ``exc_info``) and
    so the frames it passed through: what a server's log handlers, which format and drop records, do not."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("then", ["stall", "reset", "end"])
@pytest.mark.parametrize("handler", sorted(HANDLERS))
async def test_a_partial_message_is_freed_when_its_stream_fails(handler, then):
    with no_cyclic_gc(), no_log_records():
        engine, servicer, pusher, decoders = _server(Timing(message_timeout=0.05, session_idle=30.0))
        try:
            serve: Callable[..., object] = {
                "forward_stream": servicer.rpc_forward_stream,
                "compute_loop": servicer.rpc_compute_loop,
                "bandwidth": servicer.rpc_bandwidth,
                "inference_opening": servicer.rpc_inference,
                "inference_step": servicer.rpc_inference,
                "push": pusher.rpc_push,
            }[handler]
            stream = _Stream(HANDLERS[handler](), then)
            replies = [wire.decode([f])[0] async for f in serve(stream, None)]
            if handler != "push" and (handler, then) != ("inference_opening", "stall"):  # (those answer nothing)
                assert replies[-1].get("code") is not None  # it did fail, mid-message
            del stream, replies
            for _ in range(3):  # the event loop drops its own last references (a cancelled wait's callbacks)
                await asyncio.sleep(0)
            assert len(decoders) == 1 and decoders[0]() is None  # the decoder, and the parts it held, are gone
        finally:
            engine.close()
