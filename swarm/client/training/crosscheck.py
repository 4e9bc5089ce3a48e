"""A trainer's cross-check of stage replicas: a sampled hop of a training micro-batch is run again on a second replica
of the same blocks, and the two replicas' outputs and input gradients are compared.

Replicas of a stage hold the same weights only right after an averaging round (up to the round's rounding): between
rounds each steps on its own part of the batch, and honest outputs then differ by what a few optimizer steps change.
So a hop is checked only when both replicas signed a round (``RoundRecord``) at the trainer's own step, which they
hold until the step ends; the check's forward carries the trainer's ``TrainTag`` (the stage comes to the trainer's
step, or refuses as stale), and its backward carries none (nothing is added to the stage's gradients: the check
costs the run no samples). The input gradient is taken for a seeded random ``grad_output`` (a vector-Jacobian
product with any vector exposes a wrong Jacobian as well as the true one does), so the check needs nothing of the
micro-batch's own backward and runs right after its forward.

Two replicas that disagree (relative L2 per position above ``tolerance``) cannot be told apart by the trainer: it
records the disagreement and bans neither. With a third replica it runs the hop there too; replicas that disagree
with two others that agree are banned from this trainer's routes (``ban_seconds``). Nothing leaves them out of the
stage's averaging rounds: a trainer has no way to tell a stage whom to average with (see docs/trust.md)."""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.passes.chain_run import ChainRun
from swarm.client.passes.sequential import RemoteChain
from swarm.errors import BadInputError, SwarmError
from swarm.hop import Hop
from swarm.ids import Span
from swarm.protocol import BackwardRequest, ForwardRequest
from swarm.records import RoundRecord
from swarm.rpc.remote import Tensors
from swarm.training.run import RunConfig
from swarm.verdict import tolerance

log = logging.getLogger(__name__)
TINY = 1e-12  # a position whose values are all (near) zero compares by absolute difference


@dataclass(frozen=True)
class CrossCheckConfig:
    rate: float = 1 / 20  # of a training micro-batch's hops
    tolerance: float = 1e-3  # honest float32 replicas of one state differ by ~1e-5; a cheat that matters, by far more
    ban_seconds: float = 3600.0
    seed: int | None = None  # None: the sample is unpredictable to the servers (drawn from the system's randomness)


def divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative L2 difference of ``a`` and ``b`` at any position (over the last dimension)."""
    if a.shape != b.shape:
        return float("inf")
    a64, b64 = a.double().flatten(0, -2), b.double().flatten(0, -2)
    diff = torch.linalg.vector_norm(a64 - b64, dim=-1)
    scale = torch.maximum(torch.linalg.vector_norm(a64, dim=-1), torch.linalg.vector_norm(b64, dim=-1))
    rel = diff / scale.clamp_min(TINY)
    if not bool(torch.isfinite(rel).all()):
        return float("inf")
    return float(rel.max()) if rel.numel() else 0.0


@dataclass(frozen=True)
class Reply:
    """What one replica computed for the checked hop."""

    peer_id: str
    hidden: torch.Tensor
    grad_input: torch.Tensor


def disagreement(a: Reply, b: Reply) -> float:
    return max(divergence(a.hidden, b.hidden), divergence(a.grad_input, b.grad_input))


def verdict(replies: list[Reply], tolerance: float) -> tuple[frozenset[str], bool]:
    """The replicas to ban and whether the check settled who is right: a replica is banned when two others agree
    with one another and it agrees with neither. Two replicas that disagree settle nothing."""
    agree = {r.peer_id: {o.peer_id for o in replies if o is not r and disagreement(r, o) <= tolerance} for r in replies}
    if all(len(others) == len(replies) - 1 for others in agree.values()):
        return frozenset(), True
    backed = {p for p, others in agree.items() if others}  # agrees with at least one other replica
    if not backed:
        return frozenset(), False
    liars = frozenset(p for p in agree if p not in backed)
    return liars, bool(liars) and len(backed) >= 2


@dataclass(frozen=True)
class CheckRecord:
    """One check that found a disagreement, kept for the trainer's report and tests."""

    start: int
    end: int
    peers: tuple[str, ...]
    worst: float  # the largest disagreement between two of them
    banned: tuple[str, ...]
    settled: bool


@dataclass
class CrossChecker:
    """Called by ``RemoteChain`` after each forward node of a training micro-batch (``RemoteChain.crosscheck``)."""

    conn: SwarmConnection
    run: RunConfig
    config: CrossCheckConfig = field(default_factory=CrossCheckConfig)
    checked: int = 0  # hops checked on two replicas or more
    skipped: int = 0  # hops drawn but not checkable (no second replica at the same averaged state, or a failure)
    records: list[CheckRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.run.sync.method == "diloco":  # replicas hold different weights at every step: nothing to compare
            raise BadInputError(
                "cross-checking replicas needs them to hold the same weights at a step, which DiLoCo's replicas "
                'never do (each keeps its inner steps): run it with [averaging] method = "parameters"'
            )
        seed = self.config.seed
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._lock = threading.Lock()  # micro-batches run on several threads

    def __call__(self, chain: RemoteChain, run: ChainRun, node_id: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if run.train is None:
            return
        with self._lock:
            if self._rng.random() >= self.config.rate:
                return
            seed = self._rng.getrandbits(63)
        try:
            self._check(chain, run, run.hops[node_id], x, out, seed)
        except SwarmError as e:  # a probe that failed checks nothing; the routes' own failover handles the server
            self.skipped += 1
            log.info("cross-check skipped: %s", e, extra={"peer": e.peer_id})

    def _replicas(self, hop: Hop, step: int) -> list[Hop]:
        """Servers of ``hop``'s blocks in the same dtype and runtime that signed an averaging round at ``step``, the
        step the trainer is at: their weights are the round's (``hop``'s own server first, if it is one)."""
        records = [
            r
            for r in self.conn.view.servers()
            if r.start <= hop.start and hop.end <= r.end and r.dtype == hop.dtype and r.runtime == hop.runtime
        ]
        spans = {(r.start, r.end) for r in records if r.peer_id == hop.peer_id}
        if not spans:
            return []
        start, end = spans.pop()
        rounds = self.conn.store.read(self.run.rounds_key(Span(start, end)), RoundRecord)
        # a round signed at the trainer's step is this step's: its state is what the replica holds until the step ends
        at_step = {r.peer_id for r in rounds if r.step == step and (r.start, r.end) == (start, end)}
        if hop.peer_id not in at_step:
            return []
        others = [Hop.of(r, hop.start, hop.end) for r in records if r.peer_id in at_step and r.peer_id != hop.peer_id]
        return [hop, *others]

    def _check(
        self, chain: RemoteChain, run: ChainRun, hop: Hop, x: torch.Tensor, out: torch.Tensor, seed: int
    ) -> None:
        assert run.train is not None
        hops = self._replicas(hop, run.train.step)
        if len(hops) < 2:
            self.skipped += 1
            return
        rest = hops[1:]
        random.Random(seed).shuffle(rest)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        replies = [self._probe(chain, run, hops[0], x, grad, out), self._probe(chain, run, rest[0], x, grad)]
        self.checked += 1
        worst = disagreement(*replies)
        # float32 replicas: the configured tolerance; half precision rounds far more (``swarm.verdict``)
        tol = (
            self.config.tolerance if hop.dtype == "float32" else max(self.config.tolerance, tolerance(hop.dtype).worst)
        )
        if worst <= tol:
            return
        if len(rest) > 1:  # a third replica referees
            replies.append(self._probe(chain, run, rest[1], x, grad))
            worst = max(worst, *(disagreement(r, replies[-1]) for r in replies[:-1]))
        liars, settled = verdict(replies, tol)
        for peer in liars:
            self.conn.view.ban(peer, self.config.ban_seconds, for_cause=True)
        record = CheckRecord(
            hop.start, hop.end, tuple(r.peer_id for r in replies), worst, tuple(sorted(liars)), settled
        )
        self.records.append(record)
        log.warning(
            "replicas of blocks %d:%d disagree (%.3g); banned: %s",
            hop.start,
            hop.end,
            worst,
            ", ".join(record.banned) or ("nobody (two replicas: who is right cannot be told)" if not settled else ""),
        )

    def _probe(
        self,
        chain: RemoteChain,
        run: ChainRun,
        hop: Hop,
        x: torch.Tensor,
        grad: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> Reply:
        """``hop``'s output for ``x`` (``hidden`` if the micro-batch's own call gave it) and its input gradient for
        ``grad``, computed again from ``x`` without adding to the stage's gradients."""
        wire = getattr(torch, hop.dtype)
        inputs: Tensors = dict(run.aux, hidden=x.to(wire))
        if hidden is None:
            request = ForwardRequest(start=hop.start, end=hop.end, keep_for_backward=False, train=run.train)
            hidden = chain._exchange(hop, request, inputs)["hidden"].to(x.dtype)
        back = BackwardRequest(start=hop.start, end=hop.end, forward_id=None, input_grad=True, train=None)
        reply = chain._exchange(hop, back, dict(inputs, grad_output=grad.to(wire)))
        return Reply(hop.peer_id, hidden, reply["grad_input"].to(x.dtype))
