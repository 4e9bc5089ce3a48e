"""Inference steps passed from server to server along a client's route (one network crossing per hop, not two).

A client opens a session on every hop of its route as before, and gives each hop its signed ``ChainRoute``: the hops
in order, each with the session id the client opened there. A step sent with ``hops`` > 0 runs here, and its output
goes straight to the next hop of the route (``swarm.push``) while the reply (the output and this server's signed
commitment) goes to the client. The next hop takes a push only into the session the route names, only from the peer
the route puts before it (the push stream's authenticated caller), under the route's generation or a newer one; the
work counts against the client who owns the session, like its own steps.

Push connections are kept per next peer and shared by every session that passes steps to it; each has a queue and
a task that sends in order, so a slow link never holds up this server's compute. A connection that fails drops what
was queued: the client, who waits for every hop's reply, finds the hop that went silent and repairs its chain."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import torch

from peers.rpc.limits import CallerContext, GuardedFrames, StreamIdle, caller_of
from peers.rpc.sessions import Session, Sessions
from swarm import wire
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.identity import Signed, open_signed
from swarm.protocol import RPC_PUSH, ChainHop, ChainRoute, InferenceStep, PushStep, check_version
from swarm.rpc.hop import Hop
from swarm.rpc.remote import Remote
from swarm.rpc.transport import Channel

log = logging.getLogger(__name__)

Admit = Callable[[str, dict[str, object]], None]  # raises NotMemberError for a caller outside a private swarm
MAX_INBOX = 64  # steps waiting in one session (a prompt's chunks in flight); a push beyond is dropped
QUEUE_FRAMES = 4096  # frames waiting on one push connection


class Pushed:
    """A step pushed by the previous hop, waiting in its session's inbox."""

    def __init__(self, push: PushStep, tensors: dict[str, torch.Tensor]) -> None:
        self.push, self.tensors = push, tensors


def accept_route(session: Session, signed: Signed, caller: str, own_peer_id: str) -> ChainRoute:
    """Check a route the client gave and bind it to ``session``: signed by the session's owner, naming this session
    on this server exactly once, and not older than the route it replaces."""
    route = open_signed(signed, ChainRoute)  # BadInputError unless the key that signed it is ``route.client``'s
    if route.client != caller:
        raise BadInputError("the route is signed by another client than the session's")
    mine = [i for i, h in enumerate(route.hops) if h.peer_id == own_peer_id and h.session_id == session.id]
    if len(mine) != 1:
        raise BadInputError("the route must name this session on this server exactly once")
    if session.route is not None and route.generation < session.route.generation:
        raise BadInputError(f"route generation {route.generation} is older than {session.route.generation}")
    session.route, session.index = route, mine[0]
    return route


class _PushLink:
    """One kept-open push connection to a next hop, fed by a queue and drained by its own task."""

    def __init__(self, remote: Remote, hop: ChainHop) -> None:
        self.queue: asyncio.Queue[list[wire.Frame]] = asyncio.Queue()
        self.queued = 0
        self.dead = False
        self.last_used = time.monotonic()
        self._task = asyncio.create_task(self._run(remote, hop))

    async def _run(self, remote: Remote, hop: ChainHop) -> None:
        channel: Channel | None = None
        try:
            target = Hop(hop.peer_id, 0, 1, tuple(hop.maddrs), direct=hop.direct)
            channel = await remote.open_channel(target, RPC_PUSH)
            while True:
                frames = await self.queue.get()
                self.queued -= len(frames)
                await channel.send(frames)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next hop is gone or unreachable: its client finds out by the missing reply
            log.info("push connection failed: %s", e, extra={"peer": hop.peer_id})
        finally:
            self.dead = True
            if channel is not None:
                channel.close()

    def send(self, frames: list[wire.Frame]) -> None:
        if self.queued + len(frames) > QUEUE_FRAMES:
            log.warning("push queue full: step dropped")
            return
        self.queued += len(frames)
        self.last_used = time.monotonic()
        self.queue.put_nowait(frames)

    def close(self) -> None:
        self._task.cancel()


class Relay:
    """This server's side of chaining: its push connections to next hops, and the handler for pushes to it."""

    def __init__(self, remote: Remote, sessions: Sessions, timing: Timing, max_bytes: int, admit: Admit,
                 budget: wire.ByteBudget | None = None) -> None:  # fmt: skip
        self.remote = remote
        self.sessions = sessions
        self.timing = timing
        self.max_bytes = max_bytes
        self.admit = admit
        self.budget = budget
        self.peer_id = remote.creds.peer_id
        self._links: dict[tuple[str, str | None], _PushLink] = {}

    def _link(self, hop: ChainHop) -> _PushLink:
        key = (hop.peer_id, hop.direct)
        link = self._links.get(key)
        # The next hop ends a push stream idle for ``stream_idle`` (``rpc_push``), and this side would not notice: its
        # next push would vanish into the closed stream. So a link idle for half of that is closed and dialled again.
        if link is not None and not link.dead and time.monotonic() - link.last_used > self.timing.stream_idle / 2:
            link.close()
            link = None
        if link is None or link.dead:
            if len(self._links) >= 1024:  # next hops come from clients: keep this bounded
                self._prune()
            link = self._links[key] = _PushLink(self.remote, hop)
        return link

    def _prune(self) -> None:
        for key in [k for k, link in self._links.items() if link.dead or link.queue.empty()]:
            self._links.pop(key).close()

    def bind(self, session: Session, signed: Signed) -> None:
        route = accept_route(session, signed, session.caller, self.peer_id)
        if session.index + 1 < len(route.hops):
            self._link(route.hops[session.index + 1])  # dial now: the first push then finds it open

    def push(self, session: Session, step: InferenceStep, out: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Pass ``out`` (this hop's output of ``step``) to the next hop, with the step's mask and positions."""
        route = session.route
        if route is None or session.index + step.hops >= len(route.hops):
            raise BadInputError(f"a step for {step.hops} more hops, but the route has no such hops after this one")
        nxt = route.hops[session.index + 1]
        push = PushStep(client=session.caller, session_id=nxt.session_id, generation=route.generation,
                        step=step.model_copy(update={"hops": step.hops - 1}))  # fmt: skip
        carried = {"hidden": out, **{k: v for k, v in tensors.items() if k in ("attention_mask", "position_ids")}}
        self._link(nxt).send(wire.encode(self.remote.meta(push), carried))

    async def rpc_push(
        self, frames: AsyncIterator[wire.Frame], context: CallerContext | None
    ) -> AsyncIterator[wire.Frame]:
        """Steps pushed by a previous hop, back to back; each goes to the inbox of the session it names. One that
        cannot be placed is dropped and logged (the client, waiting for this hop's reply, repairs the chain)."""
        pusher = caller_of(context)
        decoder = wire.Decoder(self.max_bytes, self.budget)
        guarded = GuardedFrames(frames, decoder, self.timing.stream_idle, self.timing.message_timeout)
        try:
            while (message := await wire.read_message(guarded, decoder)) is not None:
                try:
                    await self._place(pusher, *message)
                except BadInputError as e:
                    log.info("push refused: %s", e, extra={"peer": pusher})
                finally:
                    decoder.release()  # a placed step's tensors are bounded by the inbox instead
        except StreamIdle:
            return
        except Exception as e:  # malformed frames, a stalled message: the stream ends
            log.info("push stream ended: %s", e, extra={"peer": pusher})
        finally:
            decoder.release()
        nothing: tuple[wire.Frame, ...] = ()  # a stream handler is a generator; this one never answers
        for frame in nothing:
            yield frame

    async def _place(self, pusher: str, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
        self.admit(pusher, meta)
        check_version(meta)
        push = PushStep.model_validate(meta)
        session = await self.sessions.wait_for(push.client, push.session_id, push.generation, self.timing.open_timeout)
        if session.previous != pusher:
            raise BadInputError(f"{pusher} is not the hop before session {push.session_id} on its route")
        if session.inbox.qsize() >= MAX_INBOX:
            raise BadInputError(f"session {push.session_id} has {MAX_INBOX} steps waiting")
        session.inbox.put_nowait(Pushed(push, tensors))

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
