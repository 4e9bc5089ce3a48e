"""Busy is not dead: a server that misses a step's deadline is asked, before it is blamed, a cheap liveness question
on a lane of its own (``RPC_INFO``: a unary libp2p call its RPC loop answers from counters, never waiting on the
compute queue, ``peers.rpc.servicer``). An answer within ``Timing.step_timeout`` means the server is up and its compute
is saturated: its hop is replaced and routing avoids it for a while (``SwarmView.slow``), with no ban, so it never
leaves blocks missing. No answer means it is gone or wedged: the timeout stands and the retry helper bans it.

A server runs a step of a few tokens on its RPC loop when nothing else waits (``--inline-tokens``): while such a step
computes, the loop answers nothing, so a lone step slower than the step deadline reads as dead. Under load (the case
this is for) steps batch on the compute thread and the loop stays free."""

from __future__ import annotations

import logging

from swarm.client.connection import SwarmConnection
from swarm.errors import PeerUnavailableError, SlowPeerError, SwarmError
from swarm.hop import Hop

log = logging.getLogger(__name__)

SLOW_FOR = 4.0  # a slow server is avoided by new routes for this many ban_base's (bans for failing double from one)


def timed_out(e: BaseException) -> bool:
    """A call that ended because its deadline passed (not one the server refused or broke)."""
    return isinstance(e, PeerUnavailableError) and isinstance(e.cause, TimeoutError)


async def judge_silence(conn: SwarmConnection, hop: Hop, e: SwarmError) -> SwarmError:
    """The error a hop's missed deadline ``e`` stands for: ``SlowPeerError`` if the hop's server answers a liveness
    check now (it is set aside as slow in the client's view), else ``e`` itself (it is banned as before). Any other
    error is returned unchanged."""
    if not timed_out(e):
        return e
    try:
        await conn.remote.info(hop, conn.timing.step_timeout)
    except Exception:  # no answer on the liveness lane either: gone, or wedged whole
        return e
    conn.view.slow(hop.peer_id, SLOW_FOR * conn.timing.ban_base)
    log.info("a hop missed its deadline but answers: slow, not dead (no ban)", extra={"peer": hop.peer_id})
    slow = SlowPeerError(f"peer {hop.peer_id} missed a step's deadline but answers its liveness check: busy")
    slow.peer_id, slow.cause = hop.peer_id, e
    return slow
