"""One kept-open push connection from a chained hop to a next hop (``peers.rpc.chain``): a queue drained in order
by a task of its own, so a slow link never holds up the server's compute. What waits counts in the byte budget as
its client's; each push must leave within ``Timing.write_timeout``. When the connection fails (the next hop or the
relay between them gone, a dial refused, the stream closed under pushes), the sessions that pushed through it are
handed to ``lost`` at once; a stream the next hop ended after it idled is no failure."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable

from peers.serving.counters import PeerMetrics
from peers.serving.session import Session
from swarm import wire
from swarm.config import Timing
from swarm.errors import BusyError
from swarm.hop import Hop
from swarm.protocol import RPC_PUSH
from swarm.rpc.remote import Remote
from swarm.rpc.transport import Channel

log = logging.getLogger(__name__)

QUEUE_FRAMES = 4096  # frames waiting on one push connection (their bytes count in the byte budget)


class PushLink:
    """One kept-open push connection to a next hop, fed by a queue and drained by its own task."""

    def __init__(
        self,
        remote: Remote,
        target: Hop,
        metrics: PeerMetrics,
        budget: wire.ByteBudget | None,
        timing: Timing,
        lost: Callable[[list[Session]], None] | None = None,
    ) -> None:
        """``lost``: told, once, of the sessions whose steps went through this connection when it fails."""
        self.metrics, self.budget, self.timing, self.lost = metrics, budget, timing, lost
        self.peer_id = target.peer_id
        # sessions whose steps went this way (weakly held: an ended session is forgotten by itself)
        self.sessions: weakref.WeakValueDictionary[tuple[str, str], Session] = weakref.WeakValueDictionary()
        # frames, their holder and bytes, and whether ``send`` already wrote them (then they wait here to be flushed)
        self.queue: asyncio.Queue[tuple[list[wire.Frame], str, int, bool]] = asyncio.Queue()
        self.queued = 0
        self.dead = False
        self.channel: Channel | None = None  # once open: ``send`` writes to it at once when nothing waits before
        self.last_used = time.monotonic()
        self._task = asyncio.create_task(self._run(remote, target))

    async def _run(self, remote: Remote, target: Hop) -> None:
        channel: Channel | None = None
        closed: asyncio.Task[wire.Message | None] | None = None
        try:
            channel = await asyncio.wait_for(remote.open_channel(target, RPC_PUSH), self.timing.open_timeout)
            ended = closed = asyncio.ensure_future(channel.receive())  # the next hop never answers: ends when it closes
            self.channel = channel
            while True:
                item = asyncio.ensure_future(self.queue.get())
                await asyncio.wait((item, ended), return_when=asyncio.FIRST_COMPLETED)
                if ended.done():
                    item.cancel()
                    log.info("push connection closed by the next hop", extra={"peer": target.peer_id})
                    self.metrics.push_failures += 1
                    if time.monotonic() - self.last_used < self.timing.stream_idle / 2:  # not an idle stream's end
                        self._report()
                    return
                frames, holder, nbytes, written = item.result()
                try:
                    async with asyncio.timeout(self.timing.write_timeout):  # a next hop that stops reading loses it
                        if not written:
                            await channel.send(frames)
                        await channel.flush()
                finally:
                    self._done(len(frames), holder, nbytes)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next hop is gone, unreachable or stopped reading: its clients hear it now
            log.info("push connection failed: %s", e, extra={"peer": target.peer_id})
            self.metrics.push_failures += 1
            self._report()
        finally:
            self.dead = True
            self.channel = None
            self._drop()
            if closed is not None:
                if closed.done() and not closed.cancelled():
                    closed.exception()  # retrieved: how the stream ended does not matter here
                closed.cancel()
            if channel is not None:
                channel.close()

    def _report(self) -> None:
        """The connection failed: the sessions that pushed through it and are still routed to that next hop may
        have lost a step (and would lose every next one); ``lost`` ends them, so their clients hear of it at once. A
        session its client moved to another next hop since (a polite quit's handover) has lost nothing."""
        self.dead = True
        lost = self.lost
        sessions = [s for s in self.sessions.values() if s.next_hop is not None and s.next_hop.peer_id == self.peer_id]
        self.sessions.clear()
        if sessions and lost is not None:
            lost(sessions)

    def _done(self, nframes: int, holder: str, nbytes: int) -> None:
        self.queued -= nframes
        if self.budget is not None:
            self.budget.give(nbytes, holder)

    def _drop(self) -> None:
        """Give back what waits in the queue of a connection that ended (its steps are lost: clients repair)."""
        while not self.queue.empty():
            frames, holder, nbytes, _ = self.queue.get_nowait()
            self._done(len(frames), holder, nbytes)

    def send(self, frames: list[wire.Frame], holder: str, session: Session | None = None) -> None:
        """Send ``frames`` (a step of ``holder``'s ``session``): written to the connection at once when it is open and
        nothing waits before them (the next hop starts computing before this server answers its client), else
        queued; either way the task waits until they left (the write deadline). Dropped when the queue or
        ``holder``'s budget is full."""
        if session is not None:
            self.sessions[(session.caller, session.id)] = session
        nbytes = wire.encoded_size(frames)
        try:
            if self.dead or self.queued + len(frames) > QUEUE_FRAMES:
                raise BusyError("push queue full")
            if self.budget is not None:
                self.budget.take(nbytes, holder)
        except BusyError as e:
            log.warning("push dropped: %s", e, extra={"peer": holder})
            self.metrics.push_dropped += 1
            return
        self.metrics.sent(frames)
        written = self.channel is not None and self.queued == 0  # nothing queued, sending or flushing before them
        if written:
            assert self.channel is not None
            self.channel.write(frames)
        self.queued += len(frames)
        self.last_used = time.monotonic()
        self.queue.put_nowait((frames, holder, nbytes, written))

    def close(self) -> None:
        self._task.cancel()
