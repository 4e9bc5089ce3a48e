"""Serves the servicer's streaming RPCs over the direct data plane: TLS bound to identities (see
``swarm.rpc.direct`` and ``swarm.rpc.secure``), every connection counted against a global cap and, once the caller
is known, a per-caller cap; the TLS handshake and the caller's first frame each have a deadline, so a silent or
half-open connection is closed rather than held. Once the caller is known, its frames and replies are read and written
by ``peers.rpc.framing``: counted in the server's byte budget as the caller's, with read and write deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from peers.rpc.edge import Admit, error_reply
from peers.rpc.framing import Caller, StreamLimits, WriteStalled, close_replies, read_body, write_counted
from peers.rpc.servicer import Servicer
from peers.serving.limits import CallerContext
from swarm import wire
from swarm.errors import BadInputError, BusyError, NotMemberError
from swarm.identity import Credentials, sign_record
from swarm.nat_protocol import DialbackReply, DialbackRequest, Observation, ObserveReply
from swarm.protocol import (
    RPC_BANDWIDTH,
    RPC_COMPUTE_LOOP,
    RPC_DIALBACK,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_OBSERVE,
    RPC_PUSH,
    DirectCall,
    DirectHello,
    check_version,
)
from swarm.rpc.direct import framed, frames_of, read_header, write_frame
from swarm.rpc.secure import ServerTls, client_author, server_tls

log = logging.getLogger(__name__)
Handler = Callable[[AsyncIterator[wire.Frame], CallerContext], AsyncIterator[wire.Frame]]
HANDSHAKE_FRAME = 16384  # the caller's DirectCall: a key, a signature and a token (before the caller is known)
LISTEN_BACKLOG = 100  # as asyncio's servers
MAX_DIALBACKS, DIALBACK_S = 8, 3.0  # dial-backs in progress at once, and how long one tries


@dataclass(frozen=True)
class DirectLimits:
    max_connections: int = 512  # open direct connections, all callers together (handshakes included)
    max_caller_connections: int = 32  # ...and of one caller identity
    handshake_timeout: float = 10.0  # TLS handshake plus the caller's first frame


class DirectServer:
    def __init__(
        self,
        servicer: Servicer,
        creds: Credentials,
        limits: DirectLimits,
        admit: Admit | None,
        streams: StreamLimits | None = None,
    ) -> None:
        self.handlers: dict[str, Handler] = {
            RPC_FORWARD: servicer.rpc_forward_stream,  # over TCP there is no frame limit to dodge: one path
            RPC_FORWARD_STREAM: servicer.rpc_forward_stream,
            RPC_INFERENCE: servicer.rpc_inference,
            RPC_BANDWIDTH: servicer.rpc_bandwidth,
            RPC_COMPUTE_LOOP: servicer.rpc_compute_loop,
            RPC_PUSH: servicer.rpc_push,
            RPC_OBSERVE: _observed,  # answered by ``_probe``, which knows the connection's far end
            RPC_DIALBACK: _dialback,
        }
        self.creds, self.limits, self.admit = creds, limits, admit
        self.streams = streams or StreamLimits()
        self.budget = servicer.budget
        self.metrics = servicer.metrics
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self.tls: ServerTls | None = None
        self.open = 0
        self.dialbacks = 0
        self.by_caller: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # why connections were turned away (status, tests)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: any free port); returns the port. Connections are accepted here, one by
        one, and TLS starts on each only once it is counted (``_accept``)."""
        self.tls = server_tls(self.creds)
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's servers do
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._acceptor = loop.create_task(self._accept(listener))
        port_used: int = listener.getsockname()[1]
        return port_used

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors, or a connection reset before it was taken: go on
                log.warning("direct accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            self.adopt(connection)

    def adopt(self, connection: socket.socket) -> bool:
        """Serve ``connection`` (accepted, or opened by hole punching: ``peers.rpc.punch_server``), counted before
        any TLS work, so a flood costs an accept and a close."""
        if self.open >= self.limits.max_connections or self.tls is None:
            self.refused["connections"] += 1
            connection.close()
            return False
        self.open += 1
        task = asyncio.get_running_loop().create_task(self._serve(connection))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        return True

    async def _serve(self, connection: socket.socket) -> None:
        """One accepted connection: TLS (on the socket as accepted, so no byte the client sent meanwhile is lost),
        the handshake, then the RPC it calls."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        writer: asyncio.StreamWriter | None = None
        caller: str | None = None
        tls = self.tls
        assert tls is not None
        try:
            deadline = loop.time() + self.limits.handshake_timeout
            async with asyncio.timeout_at(deadline):
                secure, _ = await loop.connect_accepted_socket(
                    lambda: protocol, connection, ssl=tls.context, ssl_handshake_timeout=self.limits.handshake_timeout
                )
            writer = asyncio.StreamWriter(secure, protocol, reader, loop)
            admitted = await self._handshake(reader, frames_of(reader, HANDSHAKE_FRAME), writer, deadline)
            if admitted is None:
                return
            caller, handler = admitted
            if handler in (_observed, _dialback):  # about the connection itself; answered, then we close first
                await self._probe(handler is _dialback, caller, connection, reader, writer, deadline)
                return
            self.by_caller[caller] += 1
            replies = handler(self._frames(reader, caller), Caller(PeerID.from_base58(caller)))
            try:
                async for frame in replies:
                    await write_counted(writer, framed(frame), self.budget, caller, self.streams)
            finally:
                await close_replies(replies)  # its cleanup (a session's cache room) runs now, not at a collection
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, OSError, WriteStalled):
            pass  # the client went away, stopped reading, or never finished its handshake
        except BadInputError as e:  # not even a frame before the call was known: nobody to answer
            log.info("direct connection refused: %s", e, extra={"peer": caller})
        except Exception:
            self.metrics.internal_errors += 1
            log.exception("direct connection failed", extra={"peer": caller})
        finally:
            self.open -= 1
            if caller is not None:
                self.by_caller[caller] -= 1
                if self.by_caller[caller] <= 0:
                    del self.by_caller[caller]
            if writer is None:
                connection.close()  # TLS never started, or failed (which closed its transport)
            else:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _probe(
        self,
        dialback: bool,
        caller: str,
        connection: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        deadline: float,
    ) -> None:
        """``swarm.observe`` (where this connection came from, as we see it, signed for the caller to show the peer
        it punches to) or ``swarm.dialback`` (whether a TCP connection back to that address, at the port the caller
        names, opens: the caller's reachability). A dial back goes only to the caller's own address, one at a time
        per connection and ``MAX_DIALBACKS`` in all."""
        host, port = connection.getpeername()[:2]
        address = f"{host}:{port}"
        seen = Observation(observer=self.creds.peer_id, caller=caller, address=address, made=time.time())
        observed = ObserveReply(address=address, signed=sign_record(self.creds.key, seen))
        frames = wire.encode(observed.model_dump(mode="json"))
        if dialback:
            async with asyncio.timeout_at(deadline):
                message = await wire.read_message(frames_of(reader, HANDSHAKE_FRAME), wire.Decoder(8192))
            if message is None:
                return
            try:
                check_version(message[0])
                request = DialbackRequest.model_validate(message[0])
                if self.dialbacks >= MAX_DIALBACKS:
                    raise BusyError("too many dial-backs in progress")
                self.dialbacks += 1
                try:
                    reached = await _dials(host, request.port, DIALBACK_S)
                finally:
                    self.dialbacks -= 1
                reply = DialbackReply(address=f"{host}:{request.port}", reached=reached)
                frames = wire.encode(reply.model_dump(mode="json"))
            except (BadInputError, BusyError, ValueError) as e:  # a malformed request (pydantic's are ValueErrors)
                frames = error_reply(e)
        for frame in frames:
            write_frame(writer, frame)
        async with asyncio.timeout(self.streams.write_timeout):
            await writer.drain()

    async def _frames(self, reader: asyncio.StreamReader, caller: str) -> AsyncIterator[wire.Frame]:
        while (size := await read_header(reader)) is not None:
            yield await read_body(reader, size, self.budget, caller, self.streams)

    async def _handshake(
        self,
        reader: asyncio.StreamReader,
        frames: AsyncIterator[wire.Frame],
        writer: asyncio.StreamWriter,
        deadline: float,
    ) -> tuple[str, Handler] | None:
        """Our hello, the caller's call: who calls which handler, or None (with an error reply where the caller
        deserves one) for a connection to close."""
        tls = self.tls
        assert tls is not None
        async with asyncio.timeout_at(deadline):
            hello = DirectHello(public_key=self.creds.public_key, signature=tls.signature)
            for frame in wire.encode(hello.model_dump(mode="json")):
                write_frame(writer, frame)
            message = await wire.read_message(frames, wire.Decoder(8192))
        if message is None:
            return None
        try:
            check_version(message[0])
            call = DirectCall.model_validate(message[0])
            caller = client_author(call.public_key, call.signature, tls.fingerprint, self.creds.peer_id)
            if caller is None:
                raise BadInputError("the caller's identity proof does not hold")
            if self.admit is not None and not self.admit(caller, call.member):
                raise NotMemberError("this is a private swarm: the caller holds no valid membership (--swarm-key)")
            handler = self.handlers.get(call.rpc)
            if handler is None:
                raise BadInputError(f"unknown RPC {call.rpc!r}")
            if self.by_caller[caller] >= self.limits.max_caller_connections:
                self.refused["caller_connections"] += 1
                raise BusyError(
                    f"too many direct connections from one caller (at most {self.limits.max_caller_connections})"
                )
        except Exception as e:
            for frame in error_reply(e):
                write_frame(writer, frame)
            async with asyncio.timeout(self.streams.write_timeout):
                await writer.drain()
            await _linger(reader)
            return None
        return caller, handler

    async def close(self) -> None:
        """Stop accepting connections (open ones end with their handlers)."""
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def _dials(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host``:``port`` opens within ``timeout`` (closed at once)."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _observed(frames: AsyncIterator[wire.Frame], caller: CallerContext) -> AsyncIterator[wire.Frame]:
    """``swarm.observe``'s place in the handler table (``DirectServer._probe`` answers it)."""
    nothing: tuple[wire.Frame, ...] = ()
    for frame in nothing:
        yield frame


async def _dialback(frames: AsyncIterator[wire.Frame], caller: CallerContext) -> AsyncIterator[wire.Frame]:
    """``swarm.dialback``'s place in the handler table (``DirectServer._probe`` answers it)."""
    nothing: tuple[wire.Frame, ...] = ()
    for frame in nothing:
        yield frame


async def _linger(reader: asyncio.StreamReader, seconds: float = 1.0, limit: int = 1 << 20) -> None:
    """Before closing on a refused caller: read and drop what it already sent (its first request, pipelined behind
    its call), for a moment. Closing with unread input makes the kernel reset the connection, and the reset would
    destroy the error reply the caller has not read yet."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(seconds):
            read = 0
            while read < limit and (data := await reader.read(65536)):
                read += len(data)
