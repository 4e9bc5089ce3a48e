"""Fetching a trainable stage's state from the live peers that serve it (a joining replica, an export), without
believing any one of them.

Where two replicas or more signed the state they ended an averaging round with (``RoundRecord``: the step and a
hash), the state is the latest such round that two of them vouch for: each one's download must match its own signed
hash, and the two must agree (an all-reduce leaves the replicas equal up to rounding). Otherwise (one replica, or
no round yet) it is the furthest replica's state, never beyond the furthest step a trainer of the run signed."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from swarm.config import Timing
from swarm.dht import RecordStore, dht_time
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.ids import Span
from swarm.records import RoundRecord, ServerRecord, TrainerProgress, stage_servers
from swarm.rpc.remote import Remote, Tensors
from swarm.training.checkpoints import state_digest
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
AGREEMENT = 1e-5  # relative to a tensor's largest value: replicas after an all-reduce differ by rounding only


@dataclass(frozen=True)
class StageSources:
    """Where a stage's state may come from: the peers holding a signed record of the run's stage, the averaging
    rounds they signed, and the furthest step a trainer of the run signed (None: no trainer has published yet)."""

    replicas: list[ServerRecord]
    rounds: list[RoundRecord]
    max_step: int | None
    period: int = 0  # the run's averaging period: a round of another step is not a round (0: any step)


def stage_sources(
    store: RecordStore, run: RunConfig, stage: Span, timing: Timing, exclude: str | None = None
) -> StageSources:
    """What the DHT holds about ``stage`` (blocking: a few DHT reads). A stage may be one step ahead of the progress
    its trainer last published (the stage steps when the batch is complete, the trainer's record follows)."""
    view = store.view(run.model_id, run.stages[-1].end)
    progress = store.read(run.trainers_key, TrainerProgress)
    latest = dht_time() + timing.clock_skew
    steps = [p.step for p in progress if run.is_trainer(p.trainer) and p.updated <= latest]
    return StageSources(
        replicas=stage_servers(view, stage, run.fingerprint, exclude),
        rounds=store.read(run.rounds_key(stage), RoundRecord),
        max_step=max(steps) + 1 if steps else None,
        period=run.average_every,
    )


def agree(a: Tensors, b: Tensors) -> bool:
    if set(a) != set(b):
        return False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        scale = float(torch.maximum(x.abs().max(), y.abs().max())) if x.numel() else 0.0
        if x.numel() and float((x - y).abs().max()) > AGREEMENT * scale:
            return False
    return True


async def _fetch(
    remote: Remote, record: ServerRecord, stage: Span, timeout: float, max_bytes: int, round_state: bool
) -> tuple[int, Tensors] | None:
    """A replica's state (``round_state``: the one it ended its last round with), or None. A current state must
    match the digest the replica sent with it: the copy it made at the step it names is the one that arrived."""
    try:
        reply, tensors = await remote.state(Hop.of(record, stage.start, stage.end), timeout, max_bytes, round_state)
    except SwarmError as e:
        log.warning("did not send its state: %s", e, extra={"peer": record.peer_id, "span": str(stage)})
        return None
    if (reply.start, reply.end) != (stage.start, stage.end):
        log.warning("sent the state of another stage", extra={"peer": record.peer_id, "span": str(stage)})
        return None
    if not round_state and (reply.digest is None or await asyncio.to_thread(state_digest, tensors) != reply.digest):
        log.warning("its state is not the one it named", extra={"peer": record.peer_id, "span": str(stage)})
        return None
    return reply.step, tensors


def signed_rounds(sources: StageSources, stage: Span) -> dict[int, dict[str, RoundRecord]]:
    """Rounds two replicas or more signed, by step: {step: {peer id: its record}}."""
    holders = {r.peer_id for r in sources.replicas}
    by_step: dict[int, dict[str, RoundRecord]] = defaultdict(dict)
    for rr in sources.rounds:
        if rr.peer_id in holders and (rr.start, rr.end) == (stage.start, stage.end):
            in_time = sources.max_step is None or rr.step <= sources.max_step
            if in_time and (not sources.period or rr.step % sources.period == 0):
                by_step[rr.step][rr.peer_id] = rr
    return {step: signed for step, signed in by_step.items() if len(signed) >= 2}


async def _from_rounds(
    remote: Remote,
    sources: StageSources,
    rounds: dict[int, dict[str, RoundRecord]],
    stage: Span,
    timeout: float,
    max_bytes: int,
) -> tuple[int, Tensors] | None:
    holders = {r.peer_id: r for r in sources.replicas}
    for step in sorted(rounds, reverse=True):
        signed = rounds[step]
        good: list[Tensors] = []
        for peer_id, rr in signed.items():
            found = await _fetch(remote, holders[peer_id], stage, timeout, max_bytes, True)
            if found is None or found[0] != step or await asyncio.to_thread(state_digest, found[1]) != rr.digest:
                log.warning("its round state is not the one it signed", extra={"peer": peer_id, "span": str(stage)})
                continue
            for other in good:
                if agree(other, found[1]):
                    return step, other
            good.append(found[1])
        log.warning("no two replicas agree on the round of step %d", step, extra={"span": str(stage)})
    return None


async def stage_state(
    remote: Remote, sources: StageSources, stage: Span, timeout: float, max_bytes: int
) -> tuple[int, Tensors] | None:
    """(step, tensors) of ``stage`` from its replicas, or None when none can be believed (then the peer starts from
    its checkpoint or the run's initial weights). ``max_bytes`` bounds one peer's reply (the stage's weights and two
    Adam moments, with room for the framing)."""
    rounds = signed_rounds(sources, stage)
    if rounds:  # two replicas signed a round: only such a round is believed
        return await _from_rounds(remote, sources, rounds, stage, timeout, max_bytes)
    best: tuple[int, Tensors] | None = None
    for r in sources.replicas:
        got = await _fetch(remote, r, stage, timeout, max_bytes, False)
        if got is None:
            continue
        if sources.max_step is not None and got[0] > sources.max_step:
            log.warning(
                "claims step %d, beyond any trainer's %d",
                got[0],
                sources.max_step,
                extra={"peer": r.peer_id, "span": str(stage)},
            )
            continue
        if best is None or got[0] > best[0]:
            best = got
    return best
