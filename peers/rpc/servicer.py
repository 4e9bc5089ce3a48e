"""RPC dispatch only: decode frames, check the protocol version, call the compute service, encode the reply.
Any error becomes an error reply to that caller; the server and other sessions carry on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2P, P2PContext

from peers.rpc.compute import ComputeService
from swarm import wire
from swarm.errors import BadInputError, SwarmError, VersionMismatchError
from swarm.protocol import (
    PROTOCOL_VERSION,
    RPC_BANDWIDTH,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_INFO,
    ComputeRequest,
    InferenceStep,
    OpenSession,
    Reply,
)

log = logging.getLogger(__name__)


def _error_reply(e: BaseException, **fields) -> list[wire.Frame]:
    if isinstance(e, SwarmError):
        log.info("refused request: %s", e, extra=fields)
        return wire.encode(Reply(ok=False, error_code=e.code, error=str(e)).model_dump())
    if isinstance(e, ValueError):  # pydantic validation of metadata
        return wire.encode(
            Reply(ok=False, error_code=BadInputError.code, error=f"malformed metadata: {e}").model_dump()
        )
    log.exception("request failed", extra=fields)
    return wire.encode(
        Reply(ok=False, error_code="swarm_error", error=f"server error: {type(e).__name__}: {e}").model_dump()
    )


def _check_version(meta: dict) -> None:
    version = meta.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(f"peer speaks protocol {version}, this server speaks {PROTOCOL_VERSION}")


class Servicer:
    def __init__(self, compute: ComputeService, info: Callable[[], dict], added_latency_s: float = 0.0) -> None:
        self.compute = compute
        self.info = info
        self.added_latency_s = added_latency_s
        self.max_bytes = compute.cfg.max_message_bytes

    async def register(self, p2p: P2P) -> None:
        await p2p.add_protobuf_handler(RPC_FORWARD, self.rpc_forward, wire.Frame)
        await p2p.add_protobuf_handler(
            RPC_FORWARD_STREAM, self.rpc_forward_stream, wire.Frame, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(
            RPC_INFERENCE, self.rpc_inference, wire.Frame, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(RPC_INFO, self.rpc_info, wire.Frame)
        await p2p.add_protobuf_handler(
            RPC_BANDWIDTH, self.rpc_bandwidth, wire.Frame, stream_input=True, stream_output=True
        )

    async def _delay(self) -> None:
        if self.added_latency_s:
            await asyncio.sleep(self.added_latency_s)

    async def _compute(self, meta: dict, tensors: dict) -> list[wire.Frame]:
        try:
            _check_version(meta)
            req = ComputeRequest.model_validate(meta)
            await self._delay()
            handler = {
                "forward": self.compute.forward,
                "backward": self.compute.backward,
                "release": self.compute.release,
                "state": self.compute.state,
                "step": self.compute.advance,
            }[req.kind]
            out = await handler(req, tensors)
            return wire.encode(Reply().model_dump(), out)
        except Exception as e:
            return _error_reply(e, kind=meta.get("kind"), span=f"{meta.get('start')}:{meta.get('end')}")

    async def rpc_forward(self, frame: wire.Frame, context: P2PContext) -> wire.Frame:
        try:
            meta, tensors = wire.decode([frame], self.max_bytes)
        except Exception as e:
            return _error_reply(e)[0]
        frames = await self._compute(meta, tensors)
        if len(frames) > 1:  # unary replies must fit one frame; the client then uses the stream variant
            return _error_reply(BadInputError("reply too large for a unary call; use the stream call"))[0]
        return frames[0]

    async def rpc_forward_stream(self, frames: AsyncIterator[wire.Frame], context: P2PContext):
        try:
            message = await wire.read_message(frames, wire.Decoder(self.max_bytes))
            if message is None:
                raise BadInputError("empty request")
        except Exception as e:
            for f in _error_reply(e):
                yield f
            return
        for f in await self._compute(*message):
            yield f

    async def rpc_compute_loop(self, frames: AsyncIterator[wire.Frame], context: P2PContext):
        """Compute requests back to back on one (direct TCP) connection, each answered in order: a client keeps a few
        such connections per server instead of opening one per call. A request that cannot be read ends it."""
        decoder = wire.Decoder(self.max_bytes)
        while True:
            try:
                message = await wire.read_message(frames, decoder)
            except Exception as e:
                for f in _error_reply(e):
                    yield f
                return
            if message is None:
                return
            for f in await self._compute(*message):
                yield f

    async def rpc_inference(self, frames: AsyncIterator[wire.Frame], context: P2PContext):
        """One session per stream: the first message opens it (and may carry the first step), each further message
        is one step; the session and its cache room end with the stream, or at the first error."""
        decoder = wire.Decoder(self.max_bytes)
        session = None
        try:
            while True:
                message = await wire.read_message(frames, decoder)
                if message is None:
                    return
                meta, tensors = message
                if session is None:
                    _check_version(meta)
                    session = await self.compute.open_session(OpenSession.model_validate(meta["open"]), tensors)
                    log.info("session opened", extra={"session": session.id, "span": str(session.sub)})
                if "step" not in meta:
                    for f in wire.encode(Reply().model_dump()):
                        yield f
                    continue
                step = InferenceStep.model_validate(meta["step"])
                await self._delay()
                out = await self.compute.step(session, step.position, tensors)
                for f in wire.encode(Reply().model_dump(), out):
                    yield f
        except Exception as e:
            for f in _error_reply(e, session=session.id if session else None):
                yield f
        finally:
            if session is not None:
                await self.compute.close_session(session)

    async def rpc_bandwidth(self, frames: AsyncIterator[wire.Frame], context: P2PContext):
        """Receive one payload message and report its size: what a joining peer times to estimate its link."""
        try:
            message = await wire.read_message(frames, wire.Decoder(self.max_bytes))
            if message is None:
                raise BadInputError("empty bandwidth probe")
            received = sum(t.numel() * t.element_size() for t in message[1].values())
        except Exception as e:
            for f in _error_reply(e):
                yield f
            return
        for f in wire.encode(Reply(stats={"bytes": received}).model_dump()):
            yield f

    async def rpc_info(self, frame: wire.Frame, context: P2PContext) -> wire.Frame:
        return wire.encode(Reply(stats=self.info()).model_dump())[0]
