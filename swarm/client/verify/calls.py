"""Verification of client-mediated forwards and backwards (``swarm.client.passes.sequential``): a call drawn with
probability ``1 / ClientConfig.verify_every`` is sent again to another server of the same blocks and weights, and
every tensor of the two replies is compared (``swarm.verdict``). On a mismatch a third server decides; a hop that
computed wrong is banned and its call fails, so the retry helper routes it again and the caller gets honest
servers' answer; a verifier that did is banned. Forward replies carry no signed commitment, so unlike an inference
session's hops (``swarm.client.verify.verifier``) a cheater caught here is not accused in the DHT."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import TypeAlias

import torch

from swarm.accusations import ACCUSATION_TTL
from swarm.client.connection import SwarmConnection
from swarm.codecs import Codec
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.protocol import BackwardRequest, ForwardRequest
from swarm.records import Capability
from swarm.rpc.remote import Tensors, unavailable
from swarm.verdict import LOSSY, Comparison, compare, tolerance

log = logging.getLogger(__name__)
Call: TypeAlias = Callable[[Hop, ForwardRequest | BackwardRequest, Tensors], Tensors]


def _as_positions(t: torch.Tensor) -> torch.Tensor:
    """Hidden states and their gradients as they are ([batch, positions, hidden]); other tensors (an adapter's
    gradients) as one position."""
    return t if t.ndim == 3 else t.reshape(1, 1, -1)


def compare_replies(a: Tensors, b: Tensors) -> Comparison | None:
    """The worst comparison of the tensors two replies share (None: they do not hold the same tensors)."""
    if set(a) != set(b):
        return None
    worst: Comparison | None = None
    for name in sorted(a):
        if a[name].shape != b[name].shape:
            return None
        cmp = compare(_as_positions(a[name]), _as_positions(b[name]))
        if worst is None or not cmp.finite or cmp.rms > worst.rms:
            worst = cmp
    return worst


class CallAudit:
    def __init__(self, conn: SwarmConnection, adapters: bool) -> None:
        cfg = conn.cfg
        self.conn = conn
        self.rate = 1.0 / cfg.verify_every if cfg.verify_every > 0 else 0.0
        self.rng = random.Random(cfg.verify_seed) if cfg.verify_seed is not None else random.SystemRandom()
        self.adapters = adapters
        self.outcomes: Counter[str] = Counter()

    def due(self) -> bool:
        return self.rate > 0 and self.rng.random() < self.rate

    def _others(self, hop: Hop, backward: bool, exclude: set[str]) -> list[Hop]:
        needs = {Capability.BACKWARD} if backward else {Capability.FORWARD}
        if self.adapters:
            needs.add(Capability.ADAPTERS)
        records = self.conn.view.servers(exclude=frozenset(exclude | {hop.peer_id}), needs=frozenset(needs))
        return [Hop.of(r, hop.start, hop.end) for r in records if r.start <= hop.start and hop.end <= r.end]

    def check(
        self, call: Call, hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors, reply: Tensors
    ) -> None:
        """Run ``request`` (with every tensor a server needs to compute it from scratch) again elsewhere and
        compare with ``hop``'s ``reply``; raises ``PeerUnavailableError`` naming ``hop`` if it computed wrong."""
        again = request.model_copy(update={"train": None, "forward_id": None})
        if isinstance(again, ForwardRequest):
            again = again.model_copy(update={"keep_for_backward": False})
        backward = isinstance(request, BackwardRequest)
        others = self._others(hop, backward, set())
        if not others:
            self.outcomes["unverifiable"] += 1
            return
        verifier = self.rng.choice(others)
        theirs = self._run(call, verifier, again, tensors)
        if theirs is None:
            return
        cmp = compare_replies(reply, theirs)
        # a lossy codec on either link rounds the replies the verifier's is compared with
        lossy = any(self.conn.remote.codec_for(h, tensors) != Codec.none for h in (hop, verifier))
        if cmp is not None and cmp.within(LOSSY if lossy else tolerance(hop.dtype, verifier.dtype)):
            self.outcomes["ok"] += 1
            return
        thirds = self._others(hop, backward, {verifier.peer_id})
        if not thirds:
            self.outcomes["unresolved"] += 1
            return
        third = self.rng.choice(thirds)
        ref = self._run(call, third, again, tensors)
        if ref is None:
            return
        lossy = lossy or self.conn.remote.codec_for(third, tensors) != Codec.none
        tol = LOSSY if lossy else tolerance(hop.dtype, verifier.dtype, third.dtype)
        hop_cmp, verifier_cmp = compare_replies(reply, ref), compare_replies(theirs, ref)
        hop_ok = hop_cmp is not None and hop_cmp.within(tol)
        verifier_ok = verifier_cmp is not None and verifier_cmp.within(tol)
        if verifier_ok and not hop_ok:
            self.outcomes["hop"] += 1
            self.conn.view.ban(hop.peer_id, ACCUSATION_TTL, for_cause=True)
            what = hop_cmp.describe() if hop_cmp is not None else "other tensors"
            raise unavailable(hop.peer_id, f"computed a wrong {request.kind} ({what} from two other servers')")
        if hop_ok and not verifier_ok:
            self.outcomes["verifier"] += 1
            self.conn.view.ban(verifier.peer_id, ACCUSATION_TTL, for_cause=True)
            log.warning("a verifier computed a wrong %s", request.kind, extra={"peer": verifier.peer_id})
            return
        self.outcomes["unresolved"] += 1

    def _run(self, call: Call, hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors) -> Tensors | None:
        try:
            return call(hop, request, tensors)
        except SwarmError as e:  # a verifier that fails is no evidence against the hop
            self.conn.retrier.note_failure(e, "verification")
            return None
