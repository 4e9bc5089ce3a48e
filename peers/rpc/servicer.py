"""RPC dispatch only: decode frames, check the protocol version, parse the typed request, call the service that
handles it, encode the typed reply. Any error becomes an error reply to that caller; the server and other sessions
carry on.

Every handler learns its caller from the context: the authenticated peer id of the libp2p stream (or what the
direct-TCP server established), which is what the per-caller limits count by. Every stream's incoming frames are
read under time limits (``GuardedFrames``): an inference session idle too long ends with ``SessionExpiredError`` and
gives its cache room back; any other idle stream just ends. Requests are counted in the server's ``ByteBudget`` from
their first frame until they are answered, so many connections sending at once cannot run it out of memory. In a
private swarm, every request must carry the caller's membership token (``admit``), checked before anything else."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from peers.rpc.chain import Relay
from peers.rpc.directory import ServerDirectory
from peers.rpc.inference import InferenceLoop
from peers.rpc.p2p_server import P2PStreams
from peers.rpc.passes import Passes
from peers.serving.compute import ComputeService
from peers.serving.limits import CallerContext, GuardedFrames, StreamIdle, StreamStalled, caller_of
from peers.serving.ports import Tensors, TrainingRpc
from peers.serving.sessions import Sessions
from swarm import wire
from swarm.codecs import Codec
from swarm.config import Timing
from swarm.errors import BadInputError, NotMemberError, StaleStepError, SwarmError
from swarm.identity import Credentials
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
    ErrorReply,
    ForwardRequest,
    InfoReply,
    InfoRequest,
    Message,
    ReleaseRequest,
    Reply,
    StateRequest,
    check_version,
)
from swarm.rpc.commit import CommitSigner
from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)
Frames = AsyncIterator[wire.Frame]
Admit = Callable[[str, "str | None"], bool]  # (caller's peer id, its membership token) -> a member?


def _reply(reply: Message, tensors: Tensors | None = None, codec: Codec | None = None) -> list[wire.Frame]:
    """``codec``: how the reply's activations travel, as the request asked (``swarm.codecs``)."""
    return wire.encode(reply.model_dump(mode="json"), tensors, codec)


def internal(e: BaseException) -> bool:
    """An error of the server's own (answered ``swarm_error``), not a refusal of what the caller sent."""
    return not isinstance(e, StreamStalled | SwarmError | ValidationError)


def error_reply(e: BaseException, **fields: object) -> list[wire.Frame]:
    if isinstance(e, StreamStalled):  # the sender's fault, not the server's
        e = BadInputError(str(e))
    if isinstance(e, SwarmError):
        log.info("refused request: %s", e, extra=fields)
        step = e.server_step if isinstance(e, StaleStepError) else None
        return _reply(ErrorReply(code=e.code, error=str(e)[:4096], server_step=step))
    if isinstance(e, ValidationError):  # pydantic: malformed metadata
        return _reply(ErrorReply(code=BadInputError.code, error=f"malformed metadata: {e}"[:4096]))
    log.exception("request failed", extra=fields)
    return _reply(ErrorReply(code="swarm_error", error=f"server error: {type(e).__name__}: {e}"[:4096]))


class Servicer:
    def __init__(
        self,
        compute: ComputeService,
        sessions: Sessions,
        info: Callable[[], InfoReply],
        *,
        max_bytes: int,
        timing: Timing,
        added_latency_s: float = 0.0,
        training: TrainingRpc | None = None,
        admit: Admit | None = None,
        budget: wire.ByteBudget | None = None,
        remote: Remote | None = None,
        directory: ServerDirectory | None = None,
    ) -> None:
        """``admit``: a private swarm's membership check (None: an open swarm); ``budget``: bytes held for callers,
        per caller and in total; ``remote``: this server's own calls, which chaining pushes steps through, and
        ``directory``: the servers of this model it trusts to chain with (either None: it answers steps but passes
        none on and takes no pushes)."""
        self.compute = compute
        self.sessions = sessions
        self.info = info
        self.max_bytes = max_bytes
        self.timing = timing
        self.added_latency_s = added_latency_s
        self.training = training
        self.admit = admit
        self.budget = budget
        self.relay = (
            None
            if remote is None or directory is None
            else Relay(remote, sessions, timing, max_bytes, self._check_member, directory, budget)
        )
        self.passes: Passes | None = None  # chained training passes, where this server chains at all
        if self.relay is not None and directory is not None:
            self.passes = Passes(compute, directory, timing, self.relay.send_pass, budget)
            self.relay.on_pass = self.passes.box.put
        signer = CommitSigner(remote.creds if remote is not None else Credentials.of(RSAPrivateKey()))
        self.inference = InferenceLoop(
            sessions, self.relay, signer, timing, self._decoder, self._check_member, self._delay, self._error_reply
        )

    def _error_reply(self, e: BaseException, **fields: object) -> list[wire.Frame]:
        """``error_reply``, counting the server's own failures (``PeerMetrics.internal_errors``)."""
        if internal(e):
            self.compute.metrics.internal_errors += 1
        return error_reply(e, **fields)

    def _decoder(self, caller: str) -> wire.Decoder:
        return self.compute.metrics.decoder(self.max_bytes, self.budget, caller)  # counts the bytes received

    def _check_member(self, caller: str, meta: dict[str, object]) -> None:
        if self.admit is None:
            return
        token = meta.get("member")
        if not self.admit(caller, token if isinstance(token, str) else None):
            raise NotMemberError("this is a private swarm: the caller holds no valid membership (--swarm-key)")

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

    def _sent(self, frames: list[wire.Frame]) -> list[wire.Frame]:
        return self.compute.metrics.sent(frames)

    async def _delay(self) -> None:
        if self.added_latency_s:
            await asyncio.sleep(self.added_latency_s)

    def _guard(self, frames: Frames, decoder: wire.Decoder, idle: float | None = None) -> GuardedFrames:
        return GuardedFrames(frames, decoder, idle or self.timing.stream_idle, self.timing.message_timeout)

    async def _compute(self, meta: dict[str, object], tensors: Tensors, caller: str) -> list[wire.Frame]:
        """Every compute request (all transports) passes here once: where it is counted and timed."""
        self.compute.active += 1
        t0, error = time.perf_counter(), None
        try:
            return await self._dispatch(meta, tensors, caller)
        except Exception as e:
            error = e
            return self._error_reply(e, kind=meta.get("kind"), span=f"{meta.get('start')}:{meta.get('end')}")
        finally:
            self.compute.active -= 1
            self.compute.metrics.observe(meta.get("kind"), error, time.perf_counter() - t0)

    async def _dispatch(self, meta: dict[str, object], tensors: Tensors, caller: str) -> list[wire.Frame]:
        self._check_member(caller, meta)
        check_version(meta)
        req = COMPUTE_REQUEST.validate_python(meta)
        await self._delay()
        if isinstance(req, ForwardRequest | BackwardRequest) and req.relay is not None:
            if self.passes is None:
                raise BadInputError("this server takes no part in chained passes")
            reply, out = await self.passes.run(req, tensors, caller)
            return _reply(reply, out)
        if isinstance(req, ForwardRequest):
            return _reply(Reply(), await self.compute.forward(req, tensors, caller), req.codec)
        if isinstance(req, BackwardRequest):
            return _reply(Reply(), await self.compute.backward(req, tensors, caller), req.codec)
        if isinstance(req, ReleaseRequest):
            self.compute.release(req, caller)
            return _reply(Reply())
        if self.training is None:
            raise BadInputError(f"{req.kind} request to a peer that holds no trainable stage")
        if isinstance(req, StateRequest):  # a copy of the stage's state, counted until its frames are sent
            return (await self.training.state(req, caller, self.budget)).frames(_reply)
        await self.training.step(req)
        return _reply(Reply())

    async def rpc_forward(self, frame: wire.Frame, context: CallerContext | None) -> wire.Frame:
        decoder = self._decoder(caller_of(context))
        try:
            message = decoder.feed(frame)
            if message is None:
                raise BadInputError("a unary request must be complete in one frame")
            frames = await self._compute(*message, caller_of(context))
        except Exception as e:
            return self._sent(self._error_reply(e))[0]
        finally:
            decoder.release()
        if len(frames) > 1:  # unary replies must fit one frame; the client then uses the stream variant
            frames = self._error_reply(BadInputError("reply too large for a unary call; use the stream call"))
        return self._sent(frames)[0]

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
            return None, self._error_reply(e)

    async def rpc_forward_stream(self, frames: Frames, context: CallerContext | None) -> Frames:
        decoder = self._decoder(caller_of(context))
        try:
            message, refusal = await self._read(self._guard(frames, decoder), "empty request")
            reply = await self._compute(*message, caller_of(context)) if message is not None else refusal
        finally:
            decoder.release()
        for f in self._sent(reply):
            yield f

    async def rpc_compute_loop(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Compute requests back to back on one (direct TCP) connection, each answered in order: a client keeps a few
        such connections per server instead of opening one per call. A request that cannot be read ends it, and so
        does ``Timing.stream_idle`` without one (the client opens a new connection)."""
        caller = caller_of(context)
        decoder = self._decoder(caller)
        guarded = self._guard(frames, decoder)
        try:
            while True:
                message, refusal = await self._read(guarded)
                if message is None:
                    for f in self._sent(refusal):
                        yield f
                    return
                reply = await self._compute(*message, caller)
                decoder.release()
                for f in self._sent(reply):
                    yield f
                del reply  # sent: not held while the connection waits (a state copy counts until its frames go)
        finally:
            decoder.release()

    async def rpc_inference(self, frames: Frames, context: CallerContext | None) -> Frames:
        """One inference session per stream (``peers.rpc.inference``)."""
        metrics = self.compute.metrics
        async for f in self.inference.serve(frames, context):
            metrics.sent_bytes += f.ByteSize()
            yield f

    async def rpc_push(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Steps a previous hop passes along a client's route (``peers.rpc.chain``)."""
        if self.relay is None:
            return
        async for f in self.relay.rpc_push(frames, context):
            yield f

    async def rpc_bandwidth(self, frames: Frames, context: CallerContext | None) -> Frames:
        """Receive one payload message and report its size: what a joining peer times to estimate its link."""
        decoder = self._decoder(caller_of(context))
        t0, error = time.perf_counter(), None
        try:
            message, reply = await self._read(self._guard(frames, decoder), "empty bandwidth probe")
            if message is not None:
                self._check_member(caller_of(context), message[0])
                check_version(message[0])
                BandwidthProbe.model_validate(message[0])
                received = sum(t.numel() * t.element_size() for t in message[1].values())
                reply = _reply(BandwidthReply(received=received))
        except Exception as e:
            error, reply = e, self._error_reply(e)
        finally:
            decoder.release()
        self.compute.metrics.observe("bandwidth", error, time.perf_counter() - t0)
        for f in self._sent(reply):
            yield f

    async def rpc_info(self, frame: wire.Frame, context: CallerContext | None) -> wire.Frame:
        metrics = self.compute.metrics
        t0, error = time.perf_counter(), None
        metrics.received_bytes += frame.ByteSize()
        try:
            meta, _ = wire.decode([frame], self.max_bytes)
            self._check_member(caller_of(context), meta)
            check_version(meta)
            InfoRequest.model_validate(meta)
            reply = _reply(self.info())
        except Exception as e:
            error, reply = e, self._error_reply(e)
        metrics.observe("info", error, time.perf_counter() - t0)
        return metrics.sent(reply)[0]
