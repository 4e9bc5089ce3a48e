"""A session's claimed first positions (``swarm.rpc.claims``) on a server: each claimed piece answered from the
kept prefix its claim names, found under the session's scopes like any reuse (``peers.serving.prefixes``)."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from peers.serving.checks import Limits
from peers.serving.counters import PeerMetrics
from peers.serving.engine import Loaded
from peers.serving.ports import Tensors
from peers.serving.prefixes import PrefixStore, Scope, copy_prefix
from peers.serving.session import Claimed, Session
from swarm.errors import BadInputError, PrefixUnknownError, SessionLengthError
from swarm.protocol import PrefixClaim


class SessionTable(Protocol):
    """What claims use of a server's session table (``peers.serving.sessions.SessionTable``)."""

    @property
    def limits(self) -> Limits: ...
    @property
    def metrics(self) -> PeerMetrics: ...
    @property
    def loaded(self) -> Loaded: ...
    @property
    def prefixes(self) -> PrefixStore | None: ...
    def scopes(self, session: Session) -> list[Scope]: ...


def claimed_piece(
    table: SessionTable, session: Session, position: int, claim: PrefixClaim, tensors: Tensors
) -> torch.Tensor:
    """A claimed piece's output (``swarm.rpc.claims``). The first, at position 0 of a fresh session, finds the
    caller's kept prefix the claim names (under the session's scopes, like any reuse; ``PrefixUnknownError``
    where there is none) and copies all of it into the session; the next pieces follow it in order."""
    if tensors:
        raise BadInputError("a claimed piece carries no tensors")
    if (
        not position < claim.end <= claim.length
        or (claim.end - position) * session.batch > table.limits.max_batch_tokens
    ):
        raise BadInputError(f"a claimed piece {position}:{claim.end} of {claim.length} positions is malformed")
    if not position:
        if session.position or session.last_start is not None:
            raise BadInputError("only a session's first positions may be claimed")
        session.claim = _find(table, session, claim)
    held = session.claim
    if held is None or (held.length, held.digest, held.next) != (claim.length, claim.digest, position):
        raise BadInputError("a claimed piece out of order (claimed pieces come first, in order)")
    held.next = claim.end
    session.reused = claim.end - position
    table.metrics.prefix_reused += session.reused * session.batch
    table.metrics.served["inference_steps"] += 1
    return held.outputs[:, position : claim.end]


def _find(table: SessionTable, session: Session, claim: PrefixClaim) -> Claimed:
    """The kept prefix ``claim`` names under the session's scopes: its KV copied into the session's cache, its
    outputs taken into the session's trail (counted there: with no room for them the claim is refused too);
    ``PrefixUnknownError`` where none is kept."""
    if claim.length + 1 > session.max_length:
        raise SessionLengthError(f"session of max_length {session.max_length} cannot claim {claim.length} positions")
    trail, store, cache = session.trail, table.prefixes, session.cache
    entry = None
    if trail is not None and store is not None and isinstance(cache, DynamicCache) and not trail.broken:
        chain, weights = bytes.fromhex(claim.digest), table.loaded.current()
        entry = store.claimed(table.scopes(session), session.sub, session.batch, chain, claim.length, weights)
        if entry is not None:
            trail.adopt(entry, claim.length)
    if entry is None or trail is None or trail.outputs is None or not isinstance(cache, DynamicCache):
        raise PrefixUnknownError(f"no kept prefix of {claim.length} positions matches the claim here: send it whole")
    copy_prefix(entry.cache, cache, 0, claim.length)
    session.position = claim.length
    return Claimed(claim.length, claim.digest, trail.outputs[:, : claim.length])
