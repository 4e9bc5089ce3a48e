"""A libp2p stream that ends while this side has nothing to send is seen to end (``swarm.rpc.transport._iterate``).

hivemind's own iterator waited for its writer after the stream's end, and the writer waited for our next frame: an
idle push link whose next hop (or relay) died was kept as if alive, and the next session's first push went into it
and was lost (the healthy next hop was then banned). Two real p2pd daemons on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P, P2PContext

from swarm import wire
from swarm.rpc.transport import P2PChannel

RPC = "swarm.test_stream_end"


async def _pair(handler) -> tuple[P2P, P2P]:
    server = await P2P.create()
    await server.add_protobuf_handler(RPC, handler, wire.Frame, stream_input=True, stream_output=True)
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    return server, client


@pytest.mark.parametrize("how", ["the handler returns", "the remote daemon dies"])
def test_an_idle_stream_that_ends_is_seen_at_once(how: str):
    async def run() -> list[object]:
        started = asyncio.Event()

        async def handler(requests: AsyncIterator[wire.Frame], _: P2PContext) -> AsyncIterator[wire.Frame]:
            started.set()
            if how == "the handler returns":
                return
            async for _frame in requests:  # reads (and answers nothing) until its daemon is gone
                pass
            yield wire.Frame()  # pragma: no cover (never reached: makes this a generator)

        server, client = await _pair(handler)
        try:
            channel = await P2PChannel.open(client, server.peer_id, RPC, 1 << 20)
            await asyncio.wait_for(started.wait(), 10)
            if how == "the remote daemon dies":
                await server.shutdown()
            # nothing was written on this side, and nothing will be: the end must still arrive
            got = await asyncio.wait_for(channel.receive(), 10)
            channel.close()
            return [got]
        finally:
            await client.shutdown()
            await server.shutdown()

    assert asyncio.run(run()) == [None]
