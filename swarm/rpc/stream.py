"""One open inference session's stream to one server (``Remote.open_session``): its messages sent, its replies read
in order and parsed, each bounded by what the step can honestly get back."""

from __future__ import annotations

import asyncio
import time

from swarm import wire
from swarm.codecs import Codec
from swarm.errors import MessageTooLargeError, SwarmError
from swarm.hop import Hop
from swarm.protocol import RPC_INFERENCE, InferenceRequest, OpenReply, R, StepReply
from swarm.rpc.remote import Remote, Tensors, _parse, unavailable
from swarm.rpc.transport import Channel


class InferenceStream:
    """One open inference session on one server: a bidirectional stream, one message group per step. The server
    ends a session at its first error, and so does this side. A chained client watches a hop's stream while it
    waits for a later hop (``watch``): the next ``receive`` takes what the watch read."""

    def __init__(self, remote: Remote, hop: Hop, channel: Channel) -> None:
        self.remote, self.hop, self.channel = remote, hop, channel
        self.closed = False
        self._watch: asyncio.Task[tuple[wire.Message | None, int]] | None = None

    def watch(self) -> asyncio.Future[tuple[wire.Message | None, int]]:
        """The stream's next message, read in the background (bounded by ``Remote.max_reply_bytes`` only: what it
        may be is known when ``receive`` takes it, and checked then). A read is never cancelled halfway (that would
        break the stream): it stays pending until a ``receive`` takes it or the stream closes."""
        if self._watch is None:
            self.channel.decoder.max_bytes = self.remote.max_reply_bytes
            self._watch = asyncio.ensure_future(self._read())
            self._watch.add_done_callback(_retrieved)
        return self._watch

    async def _read(self) -> tuple[wire.Message | None, int]:
        received = self.channel.decoder.total_bytes
        message = await self.channel.receive()
        return message, self.channel.decoder.total_bytes - received

    async def send(self, request: InferenceRequest, tensors: Tensors, codec: Codec | None = None) -> int:
        """Send one message of the session (its replies are read in order with ``receive``); its activations travel
        both ways in ``codec`` (None: exact; ``Remote.codec_for`` picks one per link). Returns the bytes sent."""
        if codec is not None and codec != Codec.none:
            request = request.model_copy(update={"codec": codec})
        try:
            frames = wire.encode(self.remote.meta(request), tensors, codec)
            sent = wire.encoded_size(frames)
            self.remote.traffic["sent_bytes"] += sent
            if request.step is not None:
                self.remote._count(codec or Codec.none, tensors)
            await self.channel.send(frames)
        except Exception as e:
            self.close()
            raise unavailable(self.hop.peer_id, "failed", e) from None
        return sent

    async def receive(self, reply: type[R], timeout: float, max_bytes: int | None = None) -> tuple[R, Tensors, int]:
        """The session's next reply (at most ``max_bytes``: what the step can honestly get back), as ``reply``, and
        the bytes it took."""
        watched, self._watch = self._watch, None
        if max_bytes is not None and watched is None:
            self.channel.decoder.max_bytes = min(max_bytes, self.remote.max_reply_bytes)
        try:
            if watched is not None:  # read already, or being read, by a watch
                async with asyncio.timeout(timeout):
                    message, received = await asyncio.shield(watched)
                if max_bytes is not None and received > max_bytes:
                    raise MessageTooLargeError(f"a reply of {received} bytes to a request bounding it at {max_bytes}")
            else:
                received = self.channel.decoder.total_bytes
                async with asyncio.timeout(timeout):  # no task per reply, unlike wait_for: a decode step's cost
                    message = await self.channel.receive()
                received = self.channel.decoder.total_bytes - received
            self.remote.traffic["received_bytes"] += received
        except Exception as e:
            self.close()
            raise unavailable(self.hop.peer_id, "failed", e) from None
        try:
            return (*_parse(message, reply, self.hop.peer_id), received)
        except SwarmError:
            self.close()
            raise

    async def exchange(
        self,
        request: InferenceRequest,
        tensors: Tensors,
        timeout: float,
        max_bytes: int | None = None,
        codec: Codec | None = None,
    ) -> Tensors:
        """Send one message and wait for its reply (a client-mediated step, or an opening without a step): the
        exchange also times the link."""
        t0 = time.perf_counter()
        sent = await self.send(request, tensors, codec)
        _, out, received = await self.receive(StepReply if request.step is not None else OpenReply, timeout, max_bytes)
        self.remote.links.observe(self.hop.peer_id, sent + received, time.perf_counter() - t0, self.hop.network_mbps)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.close()
        if self._watch is not None:
            self._watch.cancel()


def _retrieved(task: asyncio.Future[tuple[wire.Message | None, int]]) -> None:
    """A watch that ended with the stream's failure: its error is the next ``receive``'s (or nobody's)."""
    if not task.cancelled():
        task.exception()


async def open_session(remote: Remote, hop: Hop, timeout: float) -> InferenceStream:
    """An inference stream to ``hop`` through ``remote``'s connections (direct TCP where allowed, else libp2p)."""
    try:
        channel = await asyncio.wait_for(remote.open_channel(hop, RPC_INFERENCE), timeout)
    except SwarmError:
        raise
    except Exception as e:
        raise unavailable(hop.peer_id, "cannot open a session", e) from None
    return InferenceStream(remote, hop, channel)
