"""RPC dispatch: which handler answers each RPC, and which service each compute request goes to. Every handler
learns its caller from the context: the authenticated peer id of the libp2p stream (or what the direct-TCP server
established), which is what the per-caller limits count by. What every request goes through at the edge (membership,
the byte budget, time limits, error replies) is ``peers.rpc.edge``; an inference stream is ``peers.rpc.inference``,
a pushed step ``peers.rpc.chain``, a chained training pass ``peers.rpc.passes``. The parts are wired together by
``peers.rpc.assembly``.

Every stream's incoming frames are read under time limits (``GuardedFrames``): an inference session idle too long
ends with ``SessionExpiredError`` and gives its cache room back; any other idle stream just ends. Requests are counted
in the server's ``ByteBudget`` from their first frame until they are answered, so many connections sending at once
cannot run it out of memory. In a private swarm, every request must carry the caller's membership token, checked
before anything else."""

from __future__ import annotations

import time
from collections.abc import Callable

from hivemind.p2p import P2P

from peers.rpc.chain import StepPusher
from peers.rpc.edge import Edge, Frames, reply
from peers.rpc.inference import InferenceLoop
from peers.rpc.p2p_server import P2PStreams
from peers.rpc.passes import Passes
from peers.serving.limits import CallerContext, GuardedFrames, StreamIdle, caller_of
from peers.serving.pass_service import PassService
from peers.serving.ports import Tensors, TrainingRpc
from swarm import wire
from swarm.errors import BadInputError
from swarm.protocol import (
    COMPUTE_REQUEST,
    RPC_BANDWIDTH,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_INFO,
    RPC_PUSH,
    BackwardRequest,
    BandwidthProbe,
    BandwidthReply,
    ForwardRequest,
    InfoReply,
    InfoRequest,
    ReleaseRequest,
    Reply,
    StateRequest,
    check_version,
)


class Servicer:
    def __init__(
        self,
        edge: Edge,
        passes: PassService,
        inference: InferenceLoop,
        info: Callable[[], InfoReply],
        pusher: StepPusher | None = None,
        chained: Passes | None = None,
        training: TrainingRpc | None = None,
    ) -> None:
        """``pusher`` and ``chained``: this server's side of chained steps and passes (None: it answers steps but
        passes none on and takes no pushes); ``training``: a trainable stage's handlers."""
        self.edge, self.passes, self.inference, self.info = edge, passes, inference, info
        self.pusher, self.chained, self.training = pusher, chained, training
        self.metrics, self.budget = edge.metrics, edge.budget

    async def register(self, p2p: P2P, streams: P2PStreams) -> None:
        """Unary calls through hivemind (p2pd itself caps them at 4 MiB); streams through ``streams``, which bound
        what they hold and how long they wait."""
        await p2p.add_protobuf_handler(RPC_FORWARD, self.rpc_forward, wire.Frame)
        await p2p.add_protobuf_handler(RPC_INFO, self.rpc_info, wire.Frame)
        for name, handler in (
            (RPC_FORWARD_STREAM, self.rpc_forward_stream),
            (RPC_INFERENCE, self.rpc_inference),
            (RPC_BANDWIDTH, self.rpc_bandwidth),
            (RPC_PUSH, self.rpc_push),
        ):
            await streams.register(p2p, name, handler)

    async def _compute(self, meta: dict[str, object], tensors: Tensors, caller: str) -> list[wire.Frame]:
        """Every compute request (all transports) passes here once: where it is counted and timed."""
        self.metrics.active += 1
        t0, error = time.perf_counter(), None
        try:
            return await self._dispatch(meta, tensors, caller)
        except Exception as e:
            error = e
            return self.edge.error_reply(e, kind=meta.get("kind"), span=f"{meta.get('start')}:{meta.get('end')}")
        finally:
            self.metrics.active -= 1
            self.metrics.observe(meta.get("kind"), error, time.perf_counter() - t0)

    async def _dispatch(self, meta: dict[str, object], tensors: Tensors, caller: str) -> list[wire.Frame]:
        self.edge.check_member(caller, meta)
        check_version(meta)
        req = COMPUTE_REQUEST.validate_python(meta)
        await self.edge.delay()
        if isinstance(req, ForwardRequest | BackwardRequest) and req.relay is not None:
            if self.chained is None:
                raise BadInputError("this server takes no part in chained passes")
            answer, out = await self.chained.run(req, tensors, caller)
            return reply(answer, out)
        if isinstance(req, ForwardRequest):
            return reply(Reply(), await self.passes.forward(req, tensors, caller), req.codec)
        if isinstance(req, BackwardRequest):
            return reply(Reply(), await self.passes.backward(req, tensors, caller), req.codec)
        if isinstance(req, ReleaseRequest):
            self.passes.release(req, caller)
            return reply(Reply())
        if self.training is None:
            raise BadInputError(f"{req.kind} request to a peer that holds no trainable stage")
        if isinstance(req, StateRequest):  # a copy of the stage's state, counted until its frames are sent
            return (await self.training.state(req, caller, self.budget)).frames(reply)
        await self.training.step(req)
        return reply(Reply())

    async def rpc_forward(self, frame: wire.Frame, context: CallerContext | None) -> wire.Frame:
        decoder = self.edge.decoder(caller_of(context))
        try:
            message = decoder.feed(frame)
            if message is None:
                raise BadInputError("a unary request must be complete in one frame")
            frames = await self._compute(*message, caller_of(context))
        except Exception as e:
            return self.edge.sent(self.edge.error_reply(e))[0]
        finally:
            decoder.release()
        if len(frames) > 1:  # unary replies must fit one frame; the client then uses the stream variant
            frames = self.edge.error_reply(BadInputError("reply too large for a unary call; use the stream call"))
        return self.edge.sent(frames)[0]

    async def _read(
        self, frames: GuardedFrames, empty: str | None = None
    ) -> tuple[wire.Message | None, list[wire.Frame]]:
        """The next request of a stream, or the frames that answer why there is none (nothing for a stream that
        ended cleanly or idled out: nothing was asked); ``empty``: the error for a stream that ends at once."""
        try:
            message = await wire.read_message(frames, frames.decoder)
            if message is None and empty is not None:
                raise BadInputError(empty)
            return message, []
        except StreamIdle:
            return None, []
        except Exception as e:
            return None, self.edge.error_reply(e)

    async def rpc_forward_stream(self, frames: Frames, context: CallerContext | None) -> Frames:
        decoder = self.edge.decoder(caller_of(context))
        try:
            message, refusal = await self._read(self.edge.guard(frames, decoder), "empty request")
            answer = await self._compute(*message, caller_of(context)) if message is not None else refusal
        finally:
            decoder.release()
        for f in self.edge.sent(answer):
            yield f

    async def rpc_compute_loop(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Compute requests back to back on one (direct TCP) connection, each answered in order: a client keeps a few
        such connections per server instead of opening one per call. A request that cannot be read ends it, and so
        does ``Timing.stream_idle`` without one (the client opens a new connection)."""
        caller = caller_of(context)
        decoder = self.edge.decoder(caller)
        guarded = self.edge.guard(frames, decoder)
        try:
            while True:
                message, refusal = await self._read(guarded)
                if message is None:
                    for f in self.edge.sent(refusal):
                        yield f
                    return
                answer = await self._compute(*message, caller)
                decoder.release()
                for f in self.edge.sent(answer):
                    yield f
                del answer  # sent: not held while the connection waits (a state copy counts until its frames go)
        finally:
            decoder.release()

    async def rpc_inference(self, frames: Frames, context: CallerContext | None) -> Frames:
        """One inference session per stream (``peers.rpc.inference``)."""
        metrics = self.metrics
        async for f in self.inference.serve(frames, context):
            metrics.sent_bytes += f.ByteSize()
            yield f

    async def rpc_push(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Steps a previous hop passes along a client's route (``peers.rpc.chain``)."""
        if self.pusher is None:
            return
        async for f in self.pusher.rpc_push(frames, context):
            yield f

    async def rpc_bandwidth(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Receive one payload message and report its size: what a joining peer times to estimate its link."""
        decoder = self.edge.decoder(caller_of(context))
        t0, error = time.perf_counter(), None
        try:
            message, answer = await self._read(self.edge.guard(frames, decoder), "empty bandwidth probe")
            if message is not None:
                self.edge.check_member(caller_of(context), message[0])
                check_version(message[0])
                BandwidthProbe.model_validate(message[0])
                received = sum(t.numel() * t.element_size() for t in message[1].values())
                answer = reply(BandwidthReply(received=received))
        except Exception as e:
            error, answer = e, self.edge.error_reply(e)
        finally:
            decoder.release()
        self.metrics.observe("bandwidth", error, time.perf_counter() - t0)
        for f in self.edge.sent(answer):
            yield f

    async def rpc_info(self, frame: wire.Frame, context: CallerContext | None) -> wire.Frame:
        metrics = self.metrics
        t0, error = time.perf_counter(), None
        metrics.received_bytes += frame.ByteSize()
        try:
            meta, _ = wire.decode([frame], self.edge.max_bytes)
            self.edge.check_member(caller_of(context), meta)
            check_version(meta)
            InfoRequest.model_validate(meta)
            answer = reply(self.info())
        except Exception as e:
            error, answer = e, self.edge.error_reply(e)
        metrics.observe("info", error, time.perf_counter() - t0)
        return metrics.sent(answer)[0]
