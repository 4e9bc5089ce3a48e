"""Inference steps passed from server to server along a client's route (one network crossing per hop, not two).

A client opens a session on every hop of its route as before, and gives each hop its signed ``ChainRoute``: the hops
in order, each with the session id the client opened there. A step sent with ``hops`` > 0 runs here, and its output
goes straight to the next hop of the route (``swarm.push``) while the reply (the output and this server's signed
commitment) goes to the client. The next hop takes a push only into the session the route names, only from the peer
the route puts before it (the push stream's authenticated caller) and that announces, in its own signed record, the
blocks before this session's with the same weights (``peers.rpc.directory``), under the route's generation or a
newer one; the work, and the bytes of a push waiting in the session, count against the client who owns the session,
like its own steps. A hop pushes only to a next hop such a record names, at the addresses that record announces.

Push connections are kept per next peer and shared by every session that passes steps to it; each has a queue and
a task that sends in order, so a slow link never holds up this server's compute. What waits in a queue counts in the
byte budget as its client's, and each push must leave within ``Timing.write_timeout``: a next hop that stops reading
loses the connection. A connection that fails (the next hop gone, its relay gone, a dial refused, the stream closed
under pushes) drops what was queued, and every session whose steps went through it is ended at once with
``NextHopUnreachableError``: its client, watching this hop while it waits for the next one, hears it then, not at
the step's deadline, and replaces the next hop (``swarm.client.session.chain``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine

import torch

from peers.rpc.directory import ServerDirectory
from peers.rpc.edge import Edge
from peers.rpc.push_link import PushLink
from peers.serving.limits import CallerContext, StreamIdle, caller_of
from peers.serving.session import Session
from peers.serving.sessions import SessionTable
from swarm import wire
from swarm.codecs import Codec
from swarm.errors import BadInputError, BusyError, NextHopUnreachableError, UnknownHopError
from swarm.hop import Hop
from swarm.identity import Signed, open_signed
from swarm.protocol import ChainRoute, InferenceStep, PassPush, PushStep, check_version
from swarm.records import ServerRecord
from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)

MAX_INBOX = 64  # steps waiting in one session (a prompt's chunks in flight); a push beyond is dropped
MAX_WAITING = 256  # sessions with pushes that arrived before the route allowing them, all pushers together
MAX_WAITING_PER_PUSHER = 16  # ...and per pusher (anyone can push before a route is known: these bound them)
MAX_WAITING_BYTES = 64 << 20  # tensor bytes of the pushes waiting, all together
# a chained training pass's push, (pusher, metadata, tensors): ``Passes.accept`` checks, counts and logs it itself
OnPass = Callable[[str, dict[str, object], dict[str, torch.Tensor]], Coroutine[object, object, None]]


class Pushed:
    """A step pushed by the previous hop, waiting (for its session's route, or in its session's inbox); its bytes
    count in the byte budget, as ``holder``'s, until it is handled or dropped (``free``)."""

    def __init__(self, push: PushStep, tensors: dict[str, torch.Tensor], nbytes: int = 0) -> None:
        self.push, self.tensors, self.nbytes = push, tensors, nbytes
        self.placed = False  # in its session's inbox (whose end frees it)
        self._claim: tuple[wire.ByteBudget | wire.SessionRoom, str] | None = None

    def claim(self, budget: wire.ByteBudget | wire.SessionRoom | None, holder: str) -> None:
        self.free()
        if budget is not None:
            budget.take(self.nbytes, holder)
            self._claim = budget, holder

    def free(self) -> None:
        if self._claim is not None:
            budget, holder = self._claim
            self._claim = None
            budget.give(self.nbytes, holder)


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


class StepPusher:
    """This server's side of chaining: its push connections to next hops, and the handler for pushes to it."""

    def __init__(self, remote: Remote, sessions: SessionTable, directory: ServerDirectory, edge: Edge) -> None:
        self.remote, self.sessions, self.directory, self.edge = remote, sessions, directory, edge
        self.timing, self.budget, self.metrics = edge.timing, edge.budget, edge.metrics
        self.peer_id = remote.creds.peer_id
        self._links: dict[str, PushLink] = {}
        self._waiting: dict[tuple[str, str, str], list[Pushed]] = {}  # (pusher, client, session) -> early pushes
        self._tasks: set[asyncio.Task[None]] = set()
        self._local: asyncio.Task[None] | None = None  # the latest push to this server's own next session
        self._waiting_bytes = 0
        self._by_pusher: Counter[str] = Counter()
        self.on_pass: OnPass | None = None  # chained training passes

    def _link(self, record: ServerRecord) -> PushLink:
        link = self._links.get(record.peer_id)
        # The next hop ends a push stream idle for ``stream_idle`` (``rpc_push``), and this side would not notice: its
        # next push would vanish into the closed stream. So a link idle for half of that is closed and dialled again.
        if link is not None and not link.dead and time.monotonic() - link.last_used > self.timing.stream_idle / 2:
            link.close()
            link = None
        if link is None or link.dead:
            if len(self._links) >= 1024:  # next hops are servers of this model, but their number is still bounded
                self._prune()
            # the addresses its own signed record announces, never those a client wrote into its route
            # and its observers, so a NAT'd next hop is hole-punched to as a client would punch it (docs/links.md)
            target = Hop.of(record)
            link = PushLink(self.remote, target, self.metrics, self.budget, self.timing, self._lost)
            self._links[record.peer_id] = link
        return link

    def _lost(self, sessions: list[Session]) -> None:
        """A push connection failed: each session still open and still routed to that next hop ends with
        ``NextHopUnreachableError`` (its serving loop raises what arrives in its inbox, ``peers.rpc.inference``), so
        the client learns now which link broke instead of waiting out the step's deadline."""
        for session in sessions:
            nxt = session.next_hop
            if nxt is None or self.sessions.open.get((session.caller, session.id)) is not session:
                continue
            log.info(
                "ending a session: its next hop is unreachable", extra={"peer": nxt.peer_id, "session": session.id}
            )
            error = NextHopUnreachableError(f"cannot reach the route's next hop {nxt.peer_id}: steps pushed there lost")
            session.inbox.put_nowait(error)

    def _prune(self) -> None:
        for key in [k for k, link in self._links.items() if link.dead or link.queue.empty()]:
            self._links.pop(key).close()

    async def bind(self, session: Session, signed: Signed) -> None:
        """Take the client's route for ``session``; its next hop must be a server of the blocks after this session's
        with our weights, by its own signed record (which is where it is dialled)."""
        route = accept_route(session, signed, session.caller, self.peer_id)
        session.next_hop = None
        if session.index + 1 < len(route.hops):
            nxt = route.hops[session.index + 1].peer_id
            record = await self.directory.server_at(nxt, session.sub.end)
            if record is None:
                self.metrics.push_refused += 1
                raise UnknownHopError(f"the route's next hop {nxt} announces no record serving block {session.sub.end}")
            session.next_hop = record
            if record.peer_id != self.peer_id:
                self._link(record)  # dial now: the first push then finds it open

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
        if route is None or session.index + step.hops >= len(route.hops) or session.next_hop is None:
            raise BadInputError(f"a step for {step.hops} more hops, but the route has no such hops after this one")
        nxt = route.hops[session.index + 1]
        push = PushStep(
            client=session.caller,
            session_id=nxt.session_id,
            generation=route.generation,
            step=step.model_copy(update={"hops": step.hops - 1, "claim": None}),  # every position is passed on
            codec=codec,
        )
        carried = {"hidden": out, **{k: v for k, v in tensors.items() if k in ("attention_mask", "position_ids")}}
        record = session.next_hop
        if record.peer_id == self.peer_id:  # a repaired route put two spans of this server in a row: no network
            self._push_here(self.remote.meta(push), carried)
            return
        self._link(record).send(wire.encode(self.remote.meta(push), carried, codec), session.caller, session)

    def send_pass(self, record: ServerRecord, push: PassPush, tensors: dict[str, torch.Tensor], holder: str) -> None:
        """A chained training pass's output, to the next hop of the pass (``peers.rpc.passes``)."""
        if record.peer_id == self.peer_id:  # the pass names this server twice in a row: no network
            if self.on_pass is not None:
                self._tasks.add(
                    task := asyncio.create_task(self.on_pass(self.peer_id, self.remote.meta(push), tensors))
                )
                task.add_done_callback(self._tasks.discard)
            return
        self._link(record).send(wire.encode(self.remote.meta(push), tensors), holder)

    def _push_here(self, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
        """A push to this server's own next session, placed as a pushed step from elsewhere would be, in order."""
        previous = self._local

        async def place() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await self._place(self.peer_id, meta, tensors)
            except (BadInputError, BusyError) as e:
                self.metrics.push_refused += 1
                log.info("push refused: %s", e, extra={"peer": self.peer_id})

        self._local = task = asyncio.create_task(place())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def rpc_push(
        self, frames: AsyncIterator[wire.Frame], context: CallerContext | None
    ) -> AsyncIterator[wire.Frame]:
        """Steps pushed by a previous hop, back to back; each goes to the inbox of the session it names. One that
        cannot be placed is dropped and logged (the client, waiting for this hop's reply, repairs the chain)."""
        pusher = caller_of(context)
        decoder = self.edge.decoder(pusher)  # counts the bytes received
        guarded = self.edge.guard(frames, decoder)
        try:
            while (message := await wire.read_message(guarded, decoder)) is not None:
                decoder.release()  # a placed push is counted as its own (``Pushed.claim``)
                try:
                    await self._place(pusher, *message)
                except (BadInputError, BusyError) as e:
                    self.metrics.push_refused += 1
                    log.info("push refused: %s", e, extra={"peer": pusher})
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
        self.edge.check_member(pusher, meta)
        check_version(meta)
        if meta.get("kind") == "pass":  # a chained training pass's activation or gradient
            if self.on_pass is None:
                raise BadInputError("this server takes no part in chained passes")
            return await self.on_pass(pusher, meta, tensors)  # counted as a pass push's outcome, not here
        push = PushStep.model_validate(meta)
        pushed = Pushed(push, tensors, sum(t.numel() * t.element_size() for t in tensors.values()))
        key = (pusher, push.client, push.session_id)  # by pusher: another's early pushes never hold these up
        waiting = self._waiting.get(key)
        if waiting is None:
            session = self.sessions.open.get(key[1:])
            if session is not None and session.route is not None and session.route.generation >= push.generation:
                return await self._enqueue(pusher, session, pushed)
            if len(self._waiting) >= MAX_WAITING or self._by_pusher[pusher] >= MAX_WAITING_PER_PUSHER:
                raise BadInputError("too many sessions have pushes waiting for them")
            waiting = self._waiting[key] = []
            self._by_pusher[pusher] += 1
            self._tasks.add(task := asyncio.create_task(self._wait(key, push.generation)))
            task.add_done_callback(self._tasks.discard)
        if len(waiting) >= MAX_INBOX or self._waiting_bytes + pushed.nbytes > MAX_WAITING_BYTES:
            raise BadInputError(f"too many pushes wait for session {push.session_id}")
        pushed.claim(self.budget, pusher)  # the pusher's until a session takes it
        self._waiting_bytes += pushed.nbytes
        waiting.append(pushed)

    async def _wait(self, key: tuple[str, str, str], generation: int) -> None:
        pusher = key[0]
        try:
            session: Session | None = await self.sessions.wait_for(*key[1:], generation, self.timing.open_timeout)
        except BadInputError as e:
            session, why = None, e
        try:
            for pushed in list(self._waiting.get(key, [])):
                try:
                    if session is None:
                        raise why
                    await self._enqueue(pusher, session, pushed)
                except (BadInputError, BusyError) as e:
                    self.metrics.push_refused += 1
                    log.info("push refused: %s", e, extra={"peer": pusher})
        finally:
            for pushed in self._waiting.pop(key, []):
                self._waiting_bytes -= pushed.nbytes
                if not pushed.placed:
                    pushed.free()
            self._by_pusher[pusher] -= 1
            if self._by_pusher[pusher] <= 0:
                del self._by_pusher[pusher]

    async def _enqueue(self, pusher: str, session: Session, pushed: Pushed) -> None:
        if session.previous != pusher:
            raise BadInputError(f"{pusher} is not the hop before session {session.id} on its route")
        if await self.directory.server_at(pusher, session.sub.start - 1) is None:
            raise BadInputError(f"{pusher} announces no record serving block {session.sub.start - 1}")
        if session.inbox.qsize() >= MAX_INBOX:
            raise BadInputError(f"session {session.id} has {MAX_INBOX} steps waiting")
        room = session.room if session.room is not None else self.budget
        pushed.claim(room, session.caller)  # the work of the session's client: counted as its own
        pushed.placed = True
        session.inbox.put_nowait(pushed)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        for task in self._tasks:
            task.cancel()
