"""Whether a peer behind NAT can really be reached through its relays, found out before its records say so.

p2pd reports no relayed address and no reservation (``swarm.relay``), so a private peer cannot read from its daemon
whether others get through. It asks as a stranger would: a throwaway p2p daemon of its own, listening nowhere, dials
each relayed address and opens a stream to this peer's inference handler (what a client opens first), until one
gets through or ``timeout`` passes. The probe runs in a child process that dies with this one, and its daemon
with it (``swarm.owned_dht.die_with_parent``): a peer killed mid-check leaves no daemon behind. Only the addresses that
worked are announced; none working is an error the volunteer can act on (a relay that offers no relaying, or none
reachable)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
import time
from multiprocessing.connection import Connection

from hivemind.p2p import P2P, PeerID

from swarm.dht import RecordStore
from swarm.errors import BadInputError
from swarm.owned_dht import die_with_parent
from swarm.protocol import RPC_INFERENCE
from swarm.records import OBSERVER, servers
from swarm.relay import dial_addr
from swarm.rpc.punch import dialback
from swarm.rpc.secure import client_context

log = logging.getLogger(__name__)
TRY_S = 5.0  # one dial and stream through a relay (a few round trips over the internet)


async def measure(
    store: RecordStore, model_id: str, num_blocks: int, port: int, timeout: float, patience: float | None = None
) -> str | None:
    """Whether others can dial this peer at its libp2p ``port``: asked of up to two public peers' direct planes
    (``swarm.dialback``: each tries a TCP connection back to this peer's address as it sees it). "public" if one got
    through, "private" if they answered and none did, None if none answered within ``patience`` (default: three
    times ``timeout``, a dial-back's own): the peer cannot tell.

    The swarm's records are read again while no observer has answered: a peer that has just joined may see none
    yet, or only part of the swarm (a read of a loaded DHT can miss blocks), and deciding "unknown" then made a peer
    behind a symmetric NAT announce its private address (and 10 s of reading was not enough for a peer behind a
    double NAT on a loaded machine: its DHT saw no record yet). Peers that measured themselves public are asked before
    those that could not tell (``unmeasured``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (3 * timeout if patience is None else patience)
    creds, tls = store.credentials(), client_context()
    asked: set[str] = set()
    while True:
        # read on the loop, not a thread: this runs before the peer's DHT may be started again (a fork)
        records = [r for r in servers(store.view(model_id, num_blocks)).values() if r.peer_id != store.peer_id]
        ranked = sorted((r for r in records if r.reached != "relayed"), key=lambda r: r.reached != "public")
        candidates = [f"{r.peer_id}@{r.direct_address}" for r in ranked if r.direct_address]
        observers = [o for o in candidates if re.match(OBSERVER, o) and o not in asked][:2]
        asked.update(observers)
        remaining = deadline - loop.time()
        if observers and remaining > 0:
            results = await asyncio.gather(
                *(dialback(o, port, creds, tls, min(timeout, remaining)) for o in observers), return_exceptions=True
            )
            answers = [r for r in results if isinstance(r, bool)]
            for observer, r in zip(observers, results, strict=True):
                if isinstance(r, BaseException):
                    log.info("no dial-back from %s: %s", observer, r)
            if answers:
                return "public" if any(answers) else "private"
        if loop.time() + 1.0 >= deadline:
            return None
        await asyncio.sleep(1.0)


async def reachable(peer_id: str, maddrs: tuple[str, ...], timeout: float, period: float = 1.0) -> list[str]:
    """The addresses of ``maddrs`` through which a stranger opens a stream to ``peer_id``, once any does."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this process's loop or threads
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(os.getpid(), theirs, peer_id, maddrs, timeout, period), daemon=True)
    child.start()
    theirs.close()
    try:
        got = await asyncio.to_thread(lambda: mine.recv() if mine.poll(timeout + 30.0) else ("error", "no answer"))
    except EOFError:
        got = ("error", "the probe process died")
    finally:
        mine.close()
        if child.is_alive():
            child.kill()  # by the PID this process started
        child.join(5)
    kind, value = got
    if kind == "error":
        raise BadInputError(str(value))
    return list(value)


def _child(parent: int, out: Connection, peer_id: str, maddrs: tuple[str, ...], timeout: float, period: float) -> None:
    die_with_parent(parent)
    try:
        out.send(("ok", asyncio.run(_probe(peer_id, maddrs, timeout, period))))
    except Exception as e:
        out.send(("error", str(e)))
    finally:
        out.close()


async def _probe(peer_id: str, maddrs: tuple[str, ...], timeout: float, period: float) -> list[str]:
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
