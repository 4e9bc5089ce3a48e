"""Fuzzing a live server on both planes with the cases of ``tests.helpers.fuzz_cases`` (shared by
``tests/integration/test_fuzz_server.py`` and ``scripts/fuzz.py``).

Every malformed message must get an error reply or a closed connection within ``TIMEOUT`` seconds; the counters say
what each got (``outcomes``) and which error codes the server named (``codes``)."""

from __future__ import annotations

import asyncio
import random
import ssl
import struct
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError

from swarm import wire
from swarm.hop import Hop
from swarm.protocol import RPC_BANDWIDTH, RPC_COMPUTE_LOOP, RPC_FORWARD, RPC_FORWARD_STREAM, RPC_INFERENCE
from swarm.rpc.direct import TcpChannel, split_address
from tests.helpers import fuzz_cases

TIMEOUT = 15.0  # one malformed call, or one batch on a kept-open connection: never a hang
CLOSER = struct.pack(">I", 1 << 31)  # a declared size over the frame limit: ends any direct connection at once


class Hung(AssertionError):
    pass


class LiveFuzzer:
    def __init__(self, p2p: P2P, remote: Any, hop: Hop, seed: int = 0) -> None:
        self.p2p, self.remote, self.hop = p2p, remote, hop
        self.peer = PeerID.from_base58(hop.peer_id)
        self.rng = random.Random(seed)
        self.sent: Counter[str] = Counter()  # malformed messages sent, by plane
        self.outcomes: Counter[str] = Counter()  # error_reply / closed / handler_error, by plane
        self.codes: Counter[str] = Counter()  # the error codes of the error replies
        self.ok_replies: list[str] = []  # cases the server accepted (must stay empty)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def _reply(self, plane: str, message: wire.Message | None, case: str) -> None:
        if message is None:
            self.outcomes[f"{plane}:closed"] += 1
            return
        meta = message[0]
        if meta.get("ok") is False:
            self.outcomes[f"{plane}:error_reply"] += 1
            self.codes[str(meta.get("code"))] += 1
        else:
            self.ok_replies.append(f"{plane}:{case}: {str(meta)[:200]}")

    async def _bounded(self, what: str, work: Any) -> Any:
        try:
            return await asyncio.wait_for(work, TIMEOUT)
        except TimeoutError:
            raise Hung(f"{what}: no reply and no close within {TIMEOUT} s") from None

    # libp2p ------------------------------------------------------------------------------------------------------

    async def unary(self, count: int, concurrency: int = 16) -> None:
        """Single malformed frames to the unary forward handler (wire junk and request junk alike)."""
        cases: list[tuple[str, wire.Frame]] = []
        for _ in range(count):
            if self.rng.random() < 0.5:
                cases.append(("wire_junk", fuzz_cases.wire_junk(self.rng)[0]))
            else:
                name, meta, tensors = fuzz_cases.request_junk(self.rng)
                cases.append((name, wire.encode(meta, tensors)[0]))
        gate = asyncio.Semaphore(concurrency)

        async def one(case: str, frame: wire.Frame) -> None:
            async with gate:
                self.sent["p2p_unary"] += 1
                try:
                    reply = await self._bounded(
                        f"unary {case}", self.p2p.call_protobuf_handler(self.peer, RPC_FORWARD, frame, wire.Frame)
                    )
                except P2PHandlerError:
                    self.outcomes["p2p_unary:handler_error"] += 1
                    return
                self._reply("p2p_unary", wire.decode([reply]), case)

        await asyncio.gather(*(one(c, f) for c, f in cases))

    async def streams(self, count: int, concurrency: int = 8) -> None:
        """Malformed messages over libp2p streams: each a stream of its own (the handlers end a stream at its first
        error), to the forward, inference and bandwidth handlers; a tenth are raw bytes that are not even frames."""
        gate = asyncio.Semaphore(concurrency)

        async def frames_of(frames: list[wire.Frame]) -> AsyncIterator[wire.Frame]:
            for frame in frames:
                yield frame

        async def one(rpc: str, case: str, frames: list[wire.Frame]) -> None:
            async with gate:
                self.sent["p2p_stream"] += 1
                try:
                    replies = await self.p2p.iterate_protobuf_handler(self.peer, rpc, frames_of(frames), wire.Frame)
                    got = await self._bounded(f"stream {rpc} {case}", _collect(replies))
                except P2PHandlerError:
                    self.outcomes["p2p_stream:handler_error"] += 1
                    return
                self._reply("p2p_stream", wire.decode(got) if got else None, case)
                if got and len(got) > 1:
                    self.outcomes["p2p_stream:extra_frames"] += 1

        async def raw(data: bytes) -> None:
            async with gate:
                self.sent["p2p_raw"] += 1
                _, reader, writer = await self.p2p.call_binary_stream_handler(self.peer, RPC_FORWARD_STREAM)
                try:
                    writer.write(data)
                    await writer.drain()
                    await self._bounded("raw stream bytes", reader.read())  # EOF: the server closed it
                    self.outcomes["p2p_raw:closed"] += 1
                finally:
                    writer.close()

        work = []
        for _ in range(count):
            kind = self.rng.randrange(10)
            if kind == 0:  # not a hivemind frame: a bad marker byte, or a message marker and a body that is no protobuf
                body = b"\xff" + self.rng.randbytes(self.rng.randrange(0, 32))
                marker = self.rng.choice([b"\x07", P2P.MESSAGE_MARKER])
                work.append(raw(marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body))
            elif kind < 4:
                work.append(
                    one(
                        self.rng.choice([RPC_FORWARD_STREAM, RPC_BANDWIDTH]),
                        "wire_junk",
                        fuzz_cases.wire_junk(self.rng),
                    )
                )
            elif kind < 7:
                name, meta, tensors = fuzz_cases.request_junk(self.rng)
                work.append(one(RPC_FORWARD_STREAM, name, wire.encode(meta, tensors)))
            else:
                name, meta, tensors = fuzz_cases.inference_junk(self.rng)
                work.append(one(RPC_INFERENCE, name, wire.encode(meta, tensors)))
        await asyncio.gather(*work)

    # the direct plane --------------------------------------------------------------------------------------------

    async def _channel(self, rpc: str) -> TcpChannel:
        assert self.hop.direct is not None
        return await TcpChannel.open(
            self.hop.direct, self.hop.peer_id, rpc, 1 << 22, self.remote.creds, self.remote.tls, TIMEOUT
        )

    async def _until_closed(self, plane: str, channel: TcpChannel, case: str) -> None:
        """Replies until the server closes the connection: each must be an error reply."""
        while True:
            try:
                message = await self._bounded(f"{plane} {case}", channel.receive())
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, ValueError):
                message = None  # BadInputError is a ValueError: the stream ended inside a frame
            self._reply(plane, message, case)
            if message is None:
                return

    async def compute_loop(self, count: int, batch: int = 200, connections: int = 4) -> None:
        """Request junk back to back on kept-open compute connections (each answered with an error, the loop going
        on), every batch ended by wire junk or raw stream junk and then a frame the reader must refuse."""
        gate = asyncio.Semaphore(connections)

        async def one_connection(cases: list[tuple[str, list[wire.Frame]]], tail: bytes) -> None:
            async with gate:
                channel = await self._channel(RPC_COMPUTE_LOOP)
                try:
                    for _, frames in cases:
                        await channel.send(frames)
                        self.sent["direct_loop"] += 1
                    for case, _ in cases:
                        message = await self._bounded(f"compute loop {case}", channel.receive())
                        assert message is not None, f"the server closed the compute loop at {case}"
                        self._reply("direct_loop", message, case)
                    channel.writer.write(tail + CLOSER)
                    self.sent["direct_loop"] += 1
                    await channel.writer.drain()
                    await self._until_closed("direct_loop_end", channel, "tail")
                finally:
                    channel.close()

        work = []
        while count > 0:
            n = min(batch, count)
            cases = []
            for _ in range(n - 1):
                name, meta, tensors = fuzz_cases.request_junk(self.rng)
                cases.append((name, wire.encode(meta, tensors)))
            kind, data, complete = fuzz_cases.stream_junk(self.rng)
            work.append(one_connection(cases, data if complete else b""))
            count -= n
        await asyncio.gather(*work)

    async def direct_sessions(self, count: int, concurrency: int = 8) -> None:
        """Inference streams over the direct plane that cannot open a session: an error reply, then a close."""
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                name, meta, tensors = fuzz_cases.inference_junk(self.rng)
                channel = await self._channel(RPC_INFERENCE)
                try:
                    await channel.send(wire.encode(meta, tensors))
                    self.sent["direct_inference"] += 1
                    await self._until_closed("direct_inference", channel, name)
                finally:
                    channel.close()

        await asyncio.gather(*(one() for _ in range(count)))

    async def direct_handshakes(self, count: int, concurrency: int = 8) -> None:
        """TLS done, then junk instead of the signed call (wire junk, a call of the wrong shape, raw stream junk):
        the server closes the connection, answering where the junk was at least a message."""
        assert self.hop.direct is not None
        host, port = split_address(self.hop.direct)
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                kind = self.rng.randrange(3)
                if kind == 0:
                    data = b"".join(fuzz_cases.frame_bytes(f) for f in fuzz_cases.wire_junk(self.rng))
                elif kind == 1:
                    _, meta, _ = fuzz_cases.request_junk(self.rng)
                    meta.update(rpc=self.rng.choice([RPC_COMPUTE_LOOP, "nope"]), public_key="x", signature="y")
                    data = fuzz_cases.frame_bytes(wire.encode(meta)[0])
                else:
                    _, data, complete = fuzz_cases.stream_junk(self.rng)
                    data = data if complete else b""
                reader, writer = await asyncio.open_connection(host, port, ssl=self.remote.tls, server_hostname="")
                channel = TcpChannel(reader, writer, 1 << 20)
                try:
                    writer.write(data + CLOSER)
                    self.sent["direct_handshake"] += 1
                    await writer.drain()
                    hello = await self._bounded("the server's hello", channel.receive())
                    assert hello is not None and "signature" in hello[0]
                    await self._until_closed("direct_handshake", channel, "handshake")
                finally:
                    channel.close()

        await asyncio.gather(*(one() for _ in range(count)))


async def _collect(replies: AsyncIterator[wire.Frame]) -> list[wire.Frame]:
    """A stream's reply frames, up to its end or a reset (p2pd may reset a stream the server closed)."""
    got = []
    try:
        async for frame in replies:
            got.append(frame)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    return got


def vm_hwm_mib(pid: int) -> float:
    """A process's peak resident memory (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")
