"""One inference session per stream (``swarm.inference``), its steps from two sources in arrival order: the client's
own messages on this stream, and steps the previous hop of the client's route pushed (``peers.rpc.chain``).

The first message opens the session (and may carry the client's signed route and a first step). Every step is
answered on the client's stream with its output and this server's commitment (``swarm.rpc.commit``: chained, its
head signed every few steps and in the answer to a message without a step); a step for further hops is pushed to the
next one first. While the server is leaving (``peers.run.leave``), every reply says so, so that the client moves the
session elsewhere at a step boundary. The session and its cache room end with the stream, at the first
error, or after ``Timing.session_idle`` with neither a message nor a push (the client then hears
``SessionExpiredError`` when it comes back: the reply waits in the stream)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import torch

from peers.rpc.chain import Pushed, StepPusher
from peers.rpc.edge import Edge
from peers.serving.checks import Limits
from peers.serving.limits import CallerContext, GuardedFrames, StreamIdle, StreamStalled, caller_of
from peers.serving.session import Session
from peers.serving.sessions import SessionTable
from swarm import wire
from swarm.codecs import Codec
from swarm.errors import BadInputError, NextHopUnreachableError, SessionExpiredError
from swarm.protocol import InferenceRequest, InferenceStep, Message, check_version
from swarm.rpc.claims import claim_aux, piece_digest
from swarm.rpc.commit import CommitSigner, aux_digest, binding, digest

log = logging.getLogger(__name__)
Frames = AsyncIterator[wire.Frame]
NO_IDLE = 1e9  # the client's stream may stay silent while pushes feed the session: the session's own clock counts
ROOM_TOKENS = 64  # a session's room in the byte budget: this many tokens of each sequence, in and out (decode steps)


class _FromClient:
    def __init__(self, message: wire.Message, opening: bool = False) -> None:
        self.message = message
        self.opening = opening
        self.done = asyncio.Event()


class _Ended:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def take(self) -> BaseException:
        """The error, no longer held here: raised from ``serve``, whose frame holds this item, an error still held
        would be a reference cycle (error -> traceback -> frame -> item -> error) keeping the stream's decoder, and
        the partial message in it, alive until a full garbage collection."""
        error, self.error = self.error, None
        assert error is not None
        return error


def _drop_inbox(session: Session) -> None:
    """Free what waits in an ended session's inbox now (pushes count in the byte budget until freed)."""
    while not session.inbox.empty():
        item = session.inbox.get_nowait()
        if isinstance(item, Pushed):
            item.free()


def _frames(reply: Message, tensors: dict[str, torch.Tensor] | None = None) -> list[wire.Frame]:
    return wire.encode(reply.model_dump(mode="json"), tensors)


class InferenceLoop:
    """Inference streams: each opens a session in ``sessions`` and runs its steps, pushing on through ``pusher``
    (None: this server does not chain), answering with ``signer``'s commitments."""

    def __init__(
        self, sessions: SessionTable, pusher: StepPusher | None, signer: CommitSigner, edge: Edge, limits: Limits
    ) -> None:
        self.sessions, self.pusher, self.signer, self.edge, self.limits = sessions, pusher, signer, edge, limits
        self.timing, self.metrics = edge.timing, edge.metrics

    async def serve(self, frames: Frames, context: CallerContext | None) -> Frames:
        caller = caller_of(context)
        decoder = self.edge.decoder(caller)
        guarded = GuardedFrames(frames, decoder, self.timing.session_idle, self.timing.message_timeout)
        session: Session | None = None
        reader: asyncio.Task[None] | None = None
        metrics = self.metrics
        t0 = time.perf_counter()
        try:
            message = await wire.read_message(guarded, decoder)
            if message is None:
                return
            t0 = time.perf_counter()  # from the opening message's arrival, as every other request is timed
            self.edge.check_member(caller, message[0])
            check_version(message[0])
            request = InferenceRequest.model_validate(message[0])
            if request.open is None:
                raise BadInputError("the first message of an inference stream must open the session")
            session = await self.sessions.start(request.open, message[1], caller)
            self._reserve(session, decoder)
            metrics.observe("session_open", None, time.perf_counter() - t0)
            log.info("session opened", extra={"session": session.id, "span": str(session.sub), "peer": caller})
            guarded.idle = NO_IDLE
            item: object = _FromClient(message, opening=True)
            reader = asyncio.create_task(self._read(guarded, decoder, session))
            while True:
                if isinstance(item, NextHopUnreachableError):  # put there by the pusher: ``peers.rpc.chain``
                    raise item
                if isinstance(item, _Ended):
                    if item.error is not None:
                        raise item.take()
                    return
                for f in await self._handle(session, item):
                    yield f
                if isinstance(item, _FromClient):
                    item.done.set()
                try:
                    async with asyncio.timeout(self.timing.session_idle):
                        item = await session.inbox.get()
                except TimeoutError:
                    raise StreamIdle(self.timing.session_idle) from None
        except Exception as e:
            if isinstance(e, StreamIdle | StreamStalled):
                if session is None:
                    return  # nothing was opened: nothing to give back or explain
                why = "idle for" if isinstance(e, StreamIdle) else "stalled mid-message for"
                metrics.sessions_expired += 1
                e = SessionExpiredError(f"session {why} {e.seconds:g} s; reopen the session")
            elif session is None:  # the opening failed (steps count their own outcomes in _step)
                metrics.observe("session_open", e, time.perf_counter() - t0)
            if session is not None:  # free its room before anything else: the reply may wait on a slow reader
                await self.sessions.end(session)
            for f in self.edge.error_reply(e, session=session.id if session else None):
                yield f
        finally:
            if reader is not None:
                reader.cancel()
            decoder.release()
            if session is not None:
                await self.sessions.end(session)
                self.signer.end((session.caller, session.id))
                _drop_inbox(session)
                if session.room is not None:
                    session.room.close()

    def _reserve(self, session: Session, decoder: wire.Decoder) -> None:
        """Set a room aside for the session's steps and pushes, now that it is established (``wire.SessionRoom``):
        callers who fill the byte budget later get ``busy``, this session keeps its decode steps."""
        budget = decoder.budget
        if not isinstance(budget, wire.ByteBudget):
            return
        room = min(2 * session.batch * ROOM_TOKENS * self.limits.hidden_size * 4, budget.per_caller // 16)
        decoder.release()  # the opening's bytes: from here the room counts what this stream holds
        session.room = decoder.budget = wire.SessionRoom(budget, session.caller, room)

    @staticmethod
    async def _read(guarded: GuardedFrames, decoder: wire.Decoder, session: Session) -> None:
        """The client's further messages, one at a time into the session's inbox (the next is read once this one
        is answered, so the bytes it holds in the server's budget stay bounded)."""
        try:
            while (message := await wire.read_message(guarded, decoder)) is not None:
                item = _FromClient(message)
                session.inbox.put_nowait(item)
                await item.done.wait()
                decoder.release()
            session.inbox.put_nowait(_Ended())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            session.inbox.put_nowait(_Ended(e))

    async def _handle(self, session: Session, item: object) -> list[wire.Frame]:
        if (session.caller, session.id) not in self.sessions.open:
            raise BadInputError("this session has ended")
        if isinstance(item, Pushed):
            item.free()  # its bytes are the step's now, as a client's own step is once read
            step, tensors = item.push.step, item.tensors
            if step.claim is not None:  # a claim is the client's own, made to the first hop: never passed on
                raise BadInputError("a pushed step claims a prefix")
            hidden = tensors.get("hidden")
            if hidden is not None and hidden.is_floating_point():  # the previous hop sent its own dtype
                tensors = {**tensors, "hidden": hidden.to(self.limits.dtype)}
            return await self._step(session, step, tensors, item.tensors.get("hidden"), item.push.codec)
        assert isinstance(item, _FromClient)
        meta, tensors = item.message
        check_version(meta)
        request = InferenceRequest.model_validate(meta)
        if request.open is not None and not item.opening:
            raise BadInputError("this stream's session is already open")
        if request.route is not None:
            if self.pusher is None:
                raise BadInputError("this server does not chain steps")
            await self.pusher.bind(session, request.route)
            await self.sessions.notify()
        if request.step is None:
            sealed = self.signer.sealed((session.caller, session.id), _bound(session))
            if request.end:  # its prefix kept before the answer: the client's next session may reuse it
                await self.sessions.end(session)
            if request.open is not None and session.trail is not None:  # kept when it ends: a later claim may name it
                shares = session.prefix is not None and session.prefix.share and self.sessions.shares
                sealed = sealed.model_copy(update={"keeps": True, "shares": shares})
            return _frames(sealed)
        return await self._step(session, request.step, tensors, tensors.get("hidden"), request.codec)

    async def _step(
        self,
        session: Session,
        step: InferenceStep,
        tensors: dict[str, torch.Tensor],
        received: torch.Tensor | None,
        codec: Codec | None,
    ) -> list[wire.Frame]:
        """Run ``step``; push its output on if it goes further; answer with the output (in ``codec``, the client's
        choice, as the push) and the commitment to what was ``received`` and what receivers decode."""
        metrics = self.metrics
        metrics.active += 1
        t0, error = time.perf_counter(), None
        try:
            await self.edge.delay()
            result = await self.sessions.step(session, step.position, tensors, step.claim)
        except Exception as e:
            error = e
            raise
        finally:
            metrics.active -= 1
            metrics.observe("inference_step", error, time.perf_counter() - t0)
        out = result["hidden"]
        if step.hops:
            if self.pusher is None:
                raise BadInputError("this server does not chain steps")
            self.pusher.push(session, step, out, tensors, codec)
        sent = wire.as_received(out, codec)
        if step.claim is not None:  # a claimed piece: its input is named by the claim (``swarm.rpc.claims``)
            claim = step.claim
            aux, taken = claim_aux(claim.length), piece_digest(bytes.fromhex(claim.digest), step.position, claim.end)
        else:
            assert received is not None  # the step's checks required it
            n = received.shape[1]
            aux = aux_digest(step.position, n, tensors.get("position_ids"), tensors.get("attention_mask"))
            taken = digest(received)
        reply = self.signer.reply(
            (session.caller, session.id), step.position, step.tag, taken, sent, _bound(session), aux
        )
        if session.reused:  # positions answered from a kept prefix (``peers.serving.prefixes``): outside the commitment
            reply = reply.model_copy(update={"reused": session.reused})
        if self.sessions.leaving:  # the client readies this span elsewhere while its steps still run here
            return wire.encode(reply.model_copy(update={"leaving": True}).model_dump(mode="json"), result, codec)
        return wire.encode(reply.model_dump(mode="json", exclude={"leaving"}), result, codec)


def _bound(session: Session) -> str:
    return binding(session.sub.start, session.sub.end, session.adapter is not None)
