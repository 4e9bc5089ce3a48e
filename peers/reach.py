"""Whether a peer behind NAT can really be reached through its relays, found out before its records say so.

p2pd reports no relayed address and no reservation (``swarm.relay``), so a private peer cannot read from its daemon
whether others get through. It asks as a stranger would: a throwaway p2p daemon of its own, listening nowhere, dials
each relayed address and opens a stream to this peer's inference handler (what a client opens first), until one
gets through or ``timeout`` passes. Only the addresses that worked are announced; none working is an error the
volunteer can act on (a relay that offers no relaying, or none reachable)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from hivemind.p2p import P2P, PeerID

from swarm.errors import BadInputError
from swarm.protocol import RPC_INFERENCE
from swarm.relay import dial_addr

log = logging.getLogger(__name__)
TRY_S = 5.0  # one dial and stream through a relay (a few round trips over the internet)


async def reachable(peer_id: str, maddrs: tuple[str, ...], timeout: float, period: float = 1.0) -> list[str]:
    """The addresses of ``maddrs`` through which a stranger opens a stream to ``peer_id``, once any does."""
    probe = await P2P.create(no_listen=True, use_relay=True, auto_nat=False, nat_port_map=False, dht_mode="client")
    peer = PeerID.from_base58(peer_id)
    deadline = time.monotonic() + timeout
    try:
        while True:
            working = [m for m in maddrs if await _through(probe, peer, m)]
            if working:
                return working
            if time.monotonic() + period > deadline:
                raise BadInputError(
                    f"this peer is not reachable through its relays ({', '.join(maddrs) or 'none'}) after "
                    f"{timeout:g} s: give --relay-via a public peer started with --relay, or forward a port and "
                    "start with --reachability public --announce-maddr"
                )
            await asyncio.sleep(period)
    finally:
        with contextlib.suppress(Exception):
            await probe.shutdown()


async def _through(probe: P2P, peer: PeerID, maddr: str) -> bool:
    try:
        async with asyncio.timeout(TRY_S):
            await probe._client.connect(peer, [dial_addr(maddr)])
            _, _, writer = await probe.call_binary_stream_handler(peer, RPC_INFERENCE)
            writer.close()
        return True
    except Exception as e:  # not yet reserved, the relay refused, or it is gone: try again or another
        log.debug("not reached through %s: %s", maddr, e)
        return False
