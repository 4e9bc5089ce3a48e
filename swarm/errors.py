"""Errors a user of the swarm can meet. Servers send them back by ``code``; the client re-raises the same class."""

from __future__ import annotations

import sys
from collections.abc import Callable


class SwarmError(Exception):
    code = "swarm_error"
    retriable = False  # True: another peer may succeed where this one failed
    peer_id: str | None = None  # the peer the error came from (set by the transport), whom the retry helper bans
    declared = False  # named by a server's error reply; False: raised on this side (e.g. reading a reply)


class BadInputError(SwarmError, ValueError):
    """The request itself is wrong (shape, dtype, span, metadata): no other peer would accept it either."""

    code = "bad_input"


class VersionMismatchError(SwarmError):
    code = "version_mismatch"
    retriable = True


class MissingBlocksError(SwarmError):
    """No live peer serves some blocks."""

    code = "missing_blocks"

    def __init__(self, blocks: list[int], model_id: str = "") -> None:
        self.blocks = blocks
        super().__init__(f"no live peer serves block(s) {_ranges(blocks)} of model {model_id!r}")


class CacheFullError(SwarmError):
    """The server has no KV-cache room for this session."""

    code = "cache_full"
    retriable = True


class MessageTooLargeError(BadInputError):
    """A message over its receiver's byte bound, refused as its frames arrive (a request over a server's limit, or a
    reply over what its request implies). A server names it as ``bad_input``; the class is for this side's callers."""


class SessionLengthError(BadInputError):
    """A session went past the max_length it was opened with."""

    code = "session_length"


class PeerUnavailableError(SwarmError):
    """A peer did not answer, dropped the connection or failed internally."""

    code = "peer_unavailable"
    retriable = True
    # what went wrong underneath, as a typed fact (a ``TimeoutError``, the error a server named, a reply the transport
    # refused...); None: nothing underneath (see ``WrongReplyError``). Read by callers and tests instead of the text.
    cause: BaseException | None = None


class WrongReplyError(PeerUnavailableError):
    """A peer's reply is not what the request implies (other tensors, shapes or dtypes, or non-finite values to
    finite inputs): raised by the client that checked it, never named by a server (so not in ``_BY_CODE``)."""


class NextHopUnreachableError(PeerUnavailableError):
    """A chained hop could not pass a step on to the next hop of the route (its push connection failed: the next hop
    or the relay between them gone): the hop ends the session with this at once, and the client takes the next hop
    for the suspect (``swarm.client.session.chain``)."""

    code = "next_hop_unreachable"


class UnseenHopError(NextHopUnreachableError):
    """A chained hop (``reporter``) sees no record of the route's next hop (``peer_id``) serving ``block``, the first
    after its own (its ``UnknownHopError``): raised by the client, never named by a server. The retry helper reads
    that peer's record itself before blaming anyone (``Retrier.note_failure``)."""

    def __init__(self, message: str, reporter: str, block: int) -> None:
        super().__init__(message)
        self.reporter, self.block = reporter, block


class SlowPeerError(PeerUnavailableError):
    """A peer missed a step's deadline but answered a liveness check at once (``swarm.client.session.liveness``):
    busy, not dead. Its hop is replaced and new routes avoid it for a while, but it is never banned for it (raised by
    the client, never named by a server)."""


class DisagreedInputError(WrongReplyError):
    """A chained hop committed to computing on another input than the hop before it committed to giving out: one of
    the two lies, so both are replaced and the sender is the one banned (raised by the client, never named by a
    server)."""

    def __init__(self, peer_id: str) -> None:
        super().__init__(f"peer {peer_id} computed on another input than the previous hop gave out")
        self.peer_id = peer_id


class ActivationsGoneError(SwarmError):
    """The server no longer holds the forward pass a backward refers to: resend the inputs."""

    code = "activations_gone"
    retriable = True


class AdapterMissingError(SwarmError):
    """The server holds no copy of this client's adapter at the version referenced: resend the tensors."""

    code = "adapter_missing"


class StaleStepError(BadInputError):
    """A trainer is behind the stage it called (another trainer finished the global step): it must step too.
    ``server_step`` is the step the stage is at (a field of the error reply, never parsed out of the message)."""

    code = "stale_step"

    def __init__(self, message: str, server_step: int | None = None) -> None:
        super().__init__(message)
        self.server_step = server_step


class BusyError(SwarmError):
    """The server is at one of its limits (open sessions, connections, queued requests, adapter room), for this caller
    or for everyone: try another server, or again later."""

    code = "busy"
    retriable = True


class SessionExpiredError(SwarmError):
    """The server ended this inference session (idle too long, or its stream stalled): reopen it and replay."""

    code = "session_expired"
    retriable = True


class PrefixUnknownError(SessionExpiredError):
    """A step claimed a kept prefix (``swarm.rpc.claims``) this server does not hold for the caller (evicted, or
    never kept): not a fault, the client sends the step whole, in a session opened again."""

    code = "prefix_unknown"


class UnknownHopError(SwarmError):
    """A chained hop sees no signed record of the route's next hop serving the blocks after its own: a server gone
    since the client read the swarm, one that joined or moved a moment ago (this hop re-reads a shard at most every
    ``record_ttl / 4``), or a name a client made up. Not this server's fault: the client replaces that next hop
    (``swarm.client.session.chain``); reaching the retry helper, it is retried with nobody banned."""

    code = "unknown_hop"
    retriable = True


class NotMemberError(SwarmError):
    """The caller holds no valid membership of this private swarm (wrong or missing ``--swarm-key``)."""

    code = "not_member"


class DhtLostError(SwarmError):
    """A peer cannot reach its DHT any more (the DHT process died): it is invisible to the swarm and leaves."""

    code = "dht_lost"


_BY_CODE = {
    cls.code: cls
    for cls in (
        SwarmError,
        DhtLostError,
        BadInputError,
        VersionMismatchError,
        CacheFullError,
        SessionLengthError,
        PeerUnavailableError,
        NextHopUnreachableError,
        ActivationsGoneError,
        AdapterMissingError,
        StaleStepError,
        BusyError,
        SessionExpiredError,
        PrefixUnknownError,
        UnknownHopError,
        NotMemberError,
    )
}


def error_from_code(code: str, message: str, server_step: int | None = None) -> SwarmError:
    """The error class a server named in its reply (``SwarmError`` for a code this version does not know)."""
    if code == StaleStepError.code:
        return StaleStepError(message, server_step)
    return _BY_CODE.get(code, SwarmError)(message)


def _ranges(blocks: list[int]) -> str:
    out: list[list[int]] = []
    run: list[int] = []
    for b in sorted(blocks):
        if run and b != run[-1] + 1:
            out.append(run)
            run = []
        run.append(b)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def run_command(body: Callable[[], object]) -> int:
    """An entry point's body: a SwarmError becomes one ``error: ...`` line on stderr and exit code 2."""
    try:
        body()
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
