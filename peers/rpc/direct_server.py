"""Serves the servicer's streaming RPCs over plain TCP (see ``swarm.rpc.direct`` for why and how)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from peers.rpc.servicer import Servicer
from swarm import wire
from swarm.protocol import RPC_BANDWIDTH, RPC_COMPUTE_LOOP, RPC_FORWARD, RPC_FORWARD_STREAM, RPC_INFERENCE
from swarm.rpc.direct import frames_of, read_frame, write_frame

log = logging.getLogger(__name__)
Handler = Callable[[AsyncIterator[wire.Frame], None], AsyncIterator[wire.Frame]]


class DirectServer:
    def __init__(self, servicer: Servicer) -> None:
        self.handlers: dict[str, Handler] = {
            RPC_FORWARD: servicer.rpc_forward_stream,  # over TCP there is no frame limit to dodge: one path
            RPC_FORWARD_STREAM: servicer.rpc_forward_stream,
            RPC_INFERENCE: servicer.rpc_inference,
            RPC_BANDWIDTH: servicer.rpc_bandwidth,
            RPC_COMPUTE_LOOP: servicer.rpc_compute_loop,
        }
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
        port_used: int = self.server.sockets[0].getsockname()[1]
        return port_used

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await read_frame(reader)
            handler = self.handlers.get(hello.uid) if hello is not None else None
            if handler is None:
                return
            async for frame in handler(frames_of(reader), None):
                write_frame(writer, frame)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; its session ends with the handler
        except Exception:
            log.exception("direct connection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        """Stop accepting connections (open ones end with their handlers)."""
        if self.server is not None:
            self.server.close()
            self.server = None
