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
from collections import Counter
from collections.abc import AsyncIterator, Callable

import torch

from peers.serving.counters import PeerMetrics
from peers.serving.limits import CallerContext, GuardedFrames, StreamIdle, caller_of
from peers.serving.sessions import Session, Sessions
from swarm import wire
from swarm.codecs import Codec
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.hop import Hop
from swarm.identity import Signed, open_signed
from swarm.protocol import RPC_PUSH, ChainHop, ChainRoute, InferenceStep, PushStep, check_version
from swarm.rpc.remote import Remote
from swarm.rpc.transport import Channel

log = logging.getLogger(__name__)

Admit = Callable[[str, dict[str, object]], None]  # raises NotMemberError for a caller outside a private swarm
MAX_INBOX = 64  # steps waiting in one session (a prompt's chunks in flight); a push beyond is dropped
MAX_WAITING = 256  # sessions with pushes that arrived before the route allowing them, all pushers together
MAX_WAITING_PER_PUSHER = 16  # ...and per pusher (anyone can push before a route is known: these bound them)
MAX_WAITING_BYTES = 64 << 20  # tensor bytes of the pushes waiting, all together
QUEUE_FRAMES = 4096  # frames waiting on one push connection


class Pushed:
    """A step pushed by the previous hop, waiting in its session's inbox."""

    def __init__(self, push: PushStep, tensors: dict[str, torch.Tensor], nbytes: int = 0) -> None:
        self.push, self.tensors, self.nbytes = push, tensors, nbytes


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

    def __init__(self, remote: Remote, hop: ChainHop, metrics: PeerMetrics) -> None:
        self.metrics = metrics
        self.queue: asyncio.Queue[list[wire.Frame]] = asyncio.Queue()
        self.queued = 0
        self.dead = False
        self.last_used = time.monotonic()
        self._task = asyncio.create_task(self._run(remote, hop))

    async def _run(self, remote: Remote, hop: ChainHop) -> None:
        channel: Channel | None = None
        closed: asyncio.Task[wire.Message | None] | None = None
        try:
            target = Hop(hop.peer_id, 0, 1, tuple(hop.maddrs), direct=hop.direct)
            channel = await remote.open_channel(target, RPC_PUSH)
            ended = closed = asyncio.ensure_future(channel.receive())  # the next hop never answers: ends when it closes
            while True:
                frames = asyncio.ensure_future(self.queue.get())
                await asyncio.wait((frames, ended), return_when=asyncio.FIRST_COMPLETED)
                if ended.done():
                    frames.cancel()
                    log.info("push connection closed by the next hop", extra={"peer": hop.peer_id})
                    self.metrics.push_failures += 1
                    return
                self.queued -= len(frames.result())
                await channel.send(frames.result())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next hop is gone or unreachable: its client finds out by the missing reply
            log.info("push connection failed: %s", e, extra={"peer": hop.peer_id})
            self.metrics.push_failures += 1
        finally:
            self.dead = True
            if closed is not None:
                if closed.done() and not closed.cancelled():
                    closed.exception()  # retrieved: how the stream ended does not matter here
                closed.cancel()
            if channel is not None:
                channel.close()

    def send(self, frames: list[wire.Frame]) -> None:
        if self.queued + len(frames) > QUEUE_FRAMES:
            log.warning("push queue full: step dropped")
            self.metrics.push_dropped += 1
            return
        self.metrics.sent(frames)
        self.queued += len(frames)
        self.last_used = time.monotonic()
        self.queue.put_nowait(frames)

    def close(self) -> None:
        self._task.cancel()


class Relay:
    """This server's side of chaining: its push connections to next hops, and the handler for pushes to it."""

    def __init__(
        self,
        remote: Remote,
        sessions: Sessions,
        timing: Timing,
        max_bytes: int,
        admit: Admit,
        budget: wire.ByteBudget | None = None,
    ) -> None:
        self.remote = remote
        self.sessions = sessions
        self.timing = timing
        self.max_bytes = max_bytes
        self.admit = admit
        self.budget = budget
        self.peer_id = remote.creds.peer_id
        self._links: dict[tuple[str, str | None], _PushLink] = {}
        self._waiting: dict[tuple[str, str, str], list[Pushed]] = {}  # (pusher, client, session) -> early pushes
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting_bytes = 0
        self._by_pusher: Counter[str] = Counter()

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
            link = self._links[key] = _PushLink(self.remote, hop, self.sessions.compute.metrics)
        return link

    def _prune(self) -> None:
        for key in [k for k, link in self._links.items() if link.dead or link.queue.empty()]:
            self._links.pop(key).close()

    def bind(self, session: Session, signed: Signed) -> None:
        route = accept_route(session, signed, session.caller, self.peer_id)
        if session.index + 1 < len(route.hops):
            self._link(route.hops[session.index + 1])  # dial now: the first push then finds it open

    def push(
        self,
        session: Session,
        step: InferenceStep,
        out: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        codec: Codec | None = None,
    ) -> None:
        """Pass ``out`` (this hop's output of ``step``) to the next hop, with the step's mask and positions, its
        activation in ``codec`` (the client's choice for the step)."""
        route = session.route
        if route is None or session.index + step.hops >= len(route.hops):
            raise BadInputError(f"a step for {step.hops} more hops, but the route has no such hops after this one")
        nxt = route.hops[session.index + 1]
        push = PushStep(
            client=session.caller,
            session_id=nxt.session_id,
            generation=route.generation,
            step=step.model_copy(update={"hops": step.hops - 1}),
            codec=codec,
        )
        carried = {"hidden": out, **{k: v for k, v in tensors.items() if k in ("attention_mask", "position_ids")}}
        self._link(nxt).send(wire.encode(self.remote.meta(push), carried, codec))

    async def rpc_push(
        self, frames: AsyncIterator[wire.Frame], context: CallerContext | None
    ) -> AsyncIterator[wire.Frame]:
        """Steps pushed by a previous hop, back to back; each goes to the inbox of the session it names. One that
        cannot be placed is dropped and logged (the client, waiting for this hop's reply, repairs the chain)."""
        pusher = caller_of(context)
        decoder = self.sessions.compute.metrics.decoder(self.max_bytes, self.budget, pusher)  # counts bytes received
        guarded = GuardedFrames(frames, decoder, self.timing.stream_idle, self.timing.message_timeout)
        try:
            while (message := await wire.read_message(guarded, decoder)) is not None:
                try:
                    await self._place(pusher, *message)
                except BadInputError as e:
                    self.sessions.compute.metrics.push_refused += 1
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
        """Into its session's inbox now if the session is ready for it; else behind the pushes already waiting for
        that session, which one task waits for, so a push the client's route update has not yet made welcome never
        holds up pushes to other sessions on the same connection (nor are two pushes to one session reordered)."""
        self.admit(pusher, meta)
        check_version(meta)
        push = PushStep.model_validate(meta)
        key = (pusher, push.client, push.session_id)  # by pusher: another's early pushes never hold these up
        waiting = self._waiting.get(key)
        if waiting is None:
            session = self.sessions.open.get(key[1:])
            if session is not None and session.route is not None and session.route.generation >= push.generation:
                return self._enqueue(pusher, session, Pushed(push, tensors))
            if len(self._waiting) >= MAX_WAITING or self._by_pusher[pusher] >= MAX_WAITING_PER_PUSHER:
                raise BadInputError("too many sessions have pushes waiting for them")
            waiting = self._waiting[key] = []
            self._by_pusher[pusher] += 1
            self._tasks.add(task := asyncio.create_task(self._wait(key, push.generation)))
            task.add_done_callback(self._tasks.discard)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if len(waiting) >= MAX_INBOX or self._waiting_bytes + nbytes > MAX_WAITING_BYTES:
            raise BadInputError(f"too many pushes wait for session {push.session_id}")
        self._waiting_bytes += nbytes
        waiting.append(Pushed(push, tensors, nbytes))

    async def _wait(self, key: tuple[str, str, str], generation: int) -> None:
        pusher = key[0]
        try:
            session: Session | None = await self.sessions.wait_for(*key[1:], generation, self.timing.open_timeout)
        except BadInputError as e:
            session, why = None, e
        try:
            for pushed in self._waiting.get(key, []):
                try:
                    if session is None:
                        raise why
                    self._enqueue(pusher, session, pushed)
                except BadInputError as e:
                    self.sessions.compute.metrics.push_refused += 1
                    log.info("push refused: %s", e, extra={"peer": pusher})
        finally:
            self._waiting_bytes -= sum(p.nbytes for p in self._waiting.pop(key, []))
            self._by_pusher[pusher] -= 1
            if self._by_pusher[pusher] <= 0:
                del self._by_pusher[pusher]

    @staticmethod
    def _enqueue(pusher: str, session: Session, pushed: Pushed) -> None:
        if session.previous != pusher:
            raise BadInputError(f"{pusher} is not the hop before session {session.id} on its route")
        if session.inbox.qsize() >= MAX_INBOX:
            raise BadInputError(f"session {session.id} has {MAX_INBOX} steps waiting")
        session.inbox.put_nowait(pushed)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        for task in self._tasks:
            task.cancel()
