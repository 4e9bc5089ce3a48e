"""What every handler does at the server's edge, whatever the request: check the caller's membership in a private
swarm, read its frames under the byte budget and the stream time limits (counting the bytes), add the emulated
latency, and turn any error into an error reply to that caller (the server and other sessions carry on)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import ValidationError

from peers.serving.counters import PeerMetrics
from peers.serving.limits import GuardedFrames, StreamStalled
from peers.serving.ports import Tensors
from swarm import wire
from swarm.codecs import Codec
from swarm.config import Timing
from swarm.errors import BadInputError, NotMemberError, StaleStepError, SwarmError
from swarm.protocol import ErrorReply, Message

log = logging.getLogger(__name__)
Frames = AsyncIterator[wire.Frame]
Admit = Callable[[str, "str | None"], bool]  # (caller's peer id, its membership token) -> a member?


def reply(message: Message, tensors: Tensors | None = None, codec: Codec | None = None) -> list[wire.Frame]:
    """``codec``: how the reply's activations travel, as the request asked (``swarm.codecs``)."""
    return wire.encode(message.model_dump(mode="json"), tensors, codec)


def internal(e: BaseException) -> bool:
    """An error of the server's own (answered ``swarm_error``), not a refusal of what the caller sent."""
    return not isinstance(e, StreamStalled | SwarmError | ValidationError)


def error_reply(e: BaseException, **fields: object) -> list[wire.Frame]:
    if isinstance(e, StreamStalled):  # the sender's fault, not the server's
        e = BadInputError(str(e))
    if isinstance(e, SwarmError):
        log.info("refused request: %s", e, extra=fields)
        step = e.server_step if isinstance(e, StaleStepError) else None
        return reply(ErrorReply(code=e.code, error=str(e)[:4096], server_step=step))
    if isinstance(e, ValidationError):  # pydantic: malformed metadata
        return reply(ErrorReply(code=BadInputError.code, error=f"malformed metadata: {e}"[:4096]))
    # the server's own failure: the caller learns its kind and where to look, never its text (paths, values,
    # addresses: whatever the exception carried stays in this server's log, under the incident's id)
    incident = uuid.uuid4().hex[:12]
    log.exception("request failed (incident %s)", incident, extra=fields)
    return reply(
        ErrorReply(code="swarm_error", error=f"server error: {type(e).__name__} (incident {incident} in its log)")
    )


@dataclass(frozen=True)
class Edge:
    """The edge's settings and counters: ``admit``, a private swarm's membership check (None: an open swarm);
    ``budget``, bytes held for callers, per caller and in total; ``metrics``, where bytes and failures count."""

    metrics: PeerMetrics
    timing: Timing
    max_bytes: int
    budget: wire.ByteBudget | None = None
    admit: Admit | None = None
    added_latency_s: float = 0.0

    def check_member(self, caller: str, meta: dict[str, object]) -> None:
        if self.admit is None:
            return
        token = meta.get("member")
        if not self.admit(caller, token if isinstance(token, str) else None):
            raise NotMemberError("this is a private swarm: the caller holds no valid membership (--swarm-key)")

    def decoder(self, caller: str) -> wire.Decoder:
        return self.metrics.decoder(self.max_bytes, self.budget, caller)  # counts the bytes received

    def guard(self, frames: Frames, decoder: wire.Decoder, idle: float | None = None) -> GuardedFrames:
        return GuardedFrames(frames, decoder, idle or self.timing.stream_idle, self.timing.message_timeout)

    async def delay(self) -> None:
        if self.added_latency_s:
            await asyncio.sleep(self.added_latency_s)

    def error_reply(self, e: BaseException, **fields: object) -> list[wire.Frame]:
        """``error_reply``, counting the server's own failures (``PeerMetrics.internal_errors``)."""
        if internal(e):
            self.metrics.internal_errors += 1
        return error_reply(e, **fields)

    def sent(self, frames: list[wire.Frame]) -> list[wire.Frame]:
        return self.metrics.sent(frames)
