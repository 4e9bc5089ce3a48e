"""RPC dispatch only: decode frames, check the protocol version, parse the typed request, call the service that
handles it, encode the typed reply. Any error becomes an error reply to that caller; the server and other sessions
carry on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from hivemind.p2p import P2P, P2PContext
from pydantic import ValidationError

from peers.rpc.compute import ComputeService, Tensors
from peers.rpc.sessions import Session, Sessions
from swarm import wire
from swarm.errors import BadInputError, StaleStepError, SwarmError
from swarm.protocol import (
    COMPUTE_REQUEST,
    RPC_BANDWIDTH,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_INFO,
    BackwardRequest,
    BandwidthProbe,
    BandwidthReply,
    ErrorReply,
    ForwardRequest,
    InferenceRequest,
    InfoReply,
    InfoRequest,
    Message,
    ReleaseRequest,
    Reply,
    StateReply,
    StateRequest,
    StepNotice,
    check_version,
)

log = logging.getLogger(__name__)
Frames = AsyncIterator[wire.Frame]


class TrainingRpc(Protocol):
    """What a trainable stage answers beyond forward and backward (``peers.training.stage``)."""

    async def state(self, req: StateRequest) -> tuple[StateReply, Tensors]: ...

    async def step(self, notice: StepNotice) -> None: ...


def _reply(reply: Message, tensors: Tensors | None = None) -> list[wire.Frame]:
    return wire.encode(reply.model_dump(mode="json"), tensors)


def error_reply(e: BaseException, **fields: object) -> list[wire.Frame]:
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
        added_latency_s: float = 0.0,
        training: TrainingRpc | None = None,
    ) -> None:
        self.compute = compute
        self.sessions = sessions
        self.info = info
        self.max_bytes = max_bytes
        self.added_latency_s = added_latency_s
        self.training = training

    async def register(self, p2p: P2P) -> None:
        await p2p.add_protobuf_handler(RPC_FORWARD, self.rpc_forward, wire.Frame)
        await p2p.add_protobuf_handler(RPC_INFO, self.rpc_info, wire.Frame)
        for name, handler in ((RPC_FORWARD_STREAM, self.rpc_forward_stream), (RPC_INFERENCE, self.rpc_inference),
                              (RPC_BANDWIDTH, self.rpc_bandwidth)):  # fmt: skip
            await p2p.add_protobuf_handler(name, handler, wire.Frame, stream_input=True, stream_output=True)

    async def _delay(self) -> None:
        if self.added_latency_s:
            await asyncio.sleep(self.added_latency_s)

    async def _compute(self, meta: dict[str, object], tensors: Tensors) -> list[wire.Frame]:
        self.compute.active += 1
        try:
            return await self._dispatch(meta, tensors)
        finally:
            self.compute.active -= 1

    async def _dispatch(self, meta: dict[str, object], tensors: Tensors) -> list[wire.Frame]:
        try:
            check_version(meta)
            req = COMPUTE_REQUEST.validate_python(meta)
            await self._delay()
            if isinstance(req, ForwardRequest):
                return _reply(Reply(), await self.compute.forward(req, tensors))
            if isinstance(req, BackwardRequest):
                return _reply(Reply(), await self.compute.backward(req, tensors))
            if isinstance(req, ReleaseRequest):
                self.compute.release(req)
                return _reply(Reply())
            if self.training is None:
                raise BadInputError(f"{req.kind} request to a peer that holds no trainable stage")
            if isinstance(req, StateRequest):
                return _reply(*await self.training.state(req))
            await self.training.step(req)
            return _reply(Reply())
        except Exception as e:
            return error_reply(e, kind=meta.get("kind"), span=f"{meta.get('start')}:{meta.get('end')}")

    async def rpc_forward(self, frame: wire.Frame, context: P2PContext) -> wire.Frame:
        try:
            meta, tensors = wire.decode([frame], self.max_bytes)
        except Exception as e:
            return error_reply(e)[0]
        frames = await self._compute(meta, tensors)
        if len(frames) > 1:  # unary replies must fit one frame; the client then uses the stream variant
            return error_reply(BadInputError("reply too large for a unary call; use the stream call"))[0]
        return frames[0]

    async def rpc_forward_stream(self, frames: Frames, context: P2PContext | None) -> Frames:
        try:
            message = await wire.read_message(frames, wire.Decoder(self.max_bytes))
            if message is None:
                raise BadInputError("empty request")
        except Exception as e:
            for f in error_reply(e):
                yield f
            return
        for f in await self._compute(*message):
            yield f

    async def rpc_compute_loop(self, frames: Frames, context: P2PContext | None) -> Frames:
        """Compute requests back to back on one (direct TCP) connection, each answered in order: a client keeps a few
        such connections per server instead of opening one per call. A request that cannot be read ends it."""
        decoder = wire.Decoder(self.max_bytes)
        while True:
            try:
                message = await wire.read_message(frames, decoder)
            except Exception as e:
                for f in error_reply(e):
                    yield f
                return
            if message is None:
                return
            for f in await self._compute(*message):
                yield f

    async def rpc_inference(self, frames: Frames, context: P2PContext | None) -> Frames:
        """One session per stream: the first message opens it (and may carry the first step), each further message
        is one step; the session and its cache room end with the stream, or at the first error."""
        decoder = wire.Decoder(self.max_bytes)
        session: Session | None = None
        try:
            while True:
                message = await wire.read_message(frames, decoder)
                if message is None:
                    return
                meta, tensors = message
                check_version(meta)
                request = InferenceRequest.model_validate(meta)
                if session is None:
                    if request.open is None:
                        raise BadInputError("the first message of an inference stream must open the session")
                    session = await self.sessions.start(request.open, tensors)
                    log.info("session opened", extra={"session": session.id, "span": str(session.sub)})
                elif request.open is not None:
                    raise BadInputError("this stream's session is already open")
                if request.step is None:
                    for f in _reply(Reply()):
                        yield f
                    continue
                self.compute.active += 1
                try:
                    await self._delay()
                    out = await self.sessions.step(session, request.step.position, tensors)
                finally:
                    self.compute.active -= 1
                for f in _reply(Reply(), out):
                    yield f
        except Exception as e:
            for f in error_reply(e, session=session.id if session else None):
                yield f
        finally:
            if session is not None:
                await self.sessions.end(session)

    async def rpc_bandwidth(self, frames: Frames, context: P2PContext | None) -> Frames:
        """Receive one payload message and report its size: what a joining peer times to estimate its link."""
        try:
            message = await wire.read_message(frames, wire.Decoder(self.max_bytes))
            if message is None:
                raise BadInputError("empty bandwidth probe")
            check_version(message[0])
            BandwidthProbe.model_validate(message[0])
            received = sum(t.numel() * t.element_size() for t in message[1].values())
        except Exception as e:
            for f in error_reply(e):
                yield f
            return
        for f in _reply(BandwidthReply(received=received)):
            yield f

    async def rpc_info(self, frame: wire.Frame, context: P2PContext) -> wire.Frame:
        try:
            meta, _ = wire.decode([frame], self.max_bytes)
            check_version(meta)
            InfoRequest.model_validate(meta)
            return _reply(self.info())[0]
        except Exception as e:
            return error_reply(e)[0]
