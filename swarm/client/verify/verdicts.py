"""Acting on verification verdicts (``swarm.client.verify.verifier``), on the session's thread between steps: the
cheater is banned, a cheating hop is replaced at the next step, and the evidence its signed commitments give is
published as an accusation (``swarm.client.verify.trust``). Evidence needs the cheater's signature over the bad step's
commitment: it is asked to sign its chain's head first (the seal every session ends with); one that will not sign is
still banned.

The accused piece is one that fails the rule by itself against the third server's output (the piece with the
largest distance), so readers who re-run just that piece's context see what the client saw. Nothing is published
over a lossy link (the rounding is the client's word), nor by a client that asked for privacy (``trusted_peers``,
``local_blocks``: evidence carries the context's hidden states)."""

from __future__ import annotations

import itertools
import logging

import torch

from swarm.accusations import ACCUSATION_TTL, Evidence
from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState, seal_chains
from swarm.client.verify.shadow import Shadow
from swarm.client.verify.verifier import Verdict
from swarm.rpc.evidence import build
from swarm.verdict import compare, tolerance

log = logging.getLogger(__name__)
DISPUTE_S = 600.0  # how long both sides of an undecided dispute are avoided (a cheater's accusation lives 3600 s)


def act(verdicts: list[Verdict], conn: SwarmConnection, chunk: int) -> list[str]:
    """Ban, replace and accuse as ``verdicts`` say; the peers caught cheating. Never raises: acting on a verdict
    must not break the session it protects."""
    caught: list[str] = []
    for v in verdicts:
        try:
            _act(v, conn, chunk, caught)
        except Exception as e:  # noqa: BLE001 - the ban (made first) stands; the accusation is best effort
            log.warning("acting on a verdict failed: %s", e, extra={"peer": v.cheater})
        finally:
            if v.shadow is not None and v.who != "ok":
                v.shadow.close()
    return caught


def _act(v: Verdict, conn: SwarmConnection, chunk: int, caught: list[str]) -> None:
    if v.who == "unresolved" and v.comparison is not None:
        v.state.link.broken = True  # two servers disagree and nothing decides: move off the hop, blaming nobody
        for party in (v.state.hop, v.shadow.hop if v.shadow is not None else None):
            if party is not None:  # ...and off both of them wherever another server serves their blocks
                conn.view.dispute(party.peer_id, DISPUTE_S)
    cheater = v.cheater
    if cheater is None:
        return
    caught.append(cheater)
    conn.view.ban(cheater, ACCUSATION_TTL, for_cause=True)
    conn.retrier.failovers += 1
    log.warning(
        "caught a server computing wrong answers: %s",
        v.reason,
        extra={"peer": cheater, "span": f"{v.state.hop.start}:{v.state.hop.end}"},
    )
    cfg = conn.cfg
    publish = conn.trust is not None and cfg.accuse and not cfg.trusted_peers and not cfg.local_blocks
    evidence = None
    if publish and not v.state.replay.lossy:
        evidence = _hop_evidence(v, conn, chunk) if v.who == "hop" else _shadow_evidence(v, conn)
    if v.who == "hop":
        v.state.link.broken = True  # replaced at the next step, its history replayed onto another server
    if evidence is not None and conn.trust is not None:
        hop = v.state.hop if v.who == "hop" else v.shadow.hop if v.shadow is not None else v.state.hop
        conn.trust.accuse(cheater, hop, evidence, v.reason)


def _starts(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)][:-1]


def _worst_piece(
    pieces: list[tuple[int, int, int, int]], wrong: torch.Tensor, right: torch.Tensor, dtypes: tuple[str, ...]
) -> tuple[int, int, int] | None:
    """Of ``pieces`` ((step, begin, end) of a step, and where that piece starts in the window), the one where
    ``wrong`` is furthest from ``right`` and fails the rule by itself; None if none does."""
    tol, best, found = tolerance(*dtypes), -1.0, None
    for step, begin, end, at in pieces:
        lo, hi = max(at, 0), at + (end - begin)
        if hi <= lo:
            continue
        cmp = compare(wrong[:, lo:hi], right[:, lo:hi])
        if not cmp.within(tol) and (not cmp.finite or cmp.rms > best):
            best, found = (float("inf") if not cmp.finite else cmp.rms), (step, begin, end)
    return found


def _hop_evidence(v: Verdict, conn: SwarmConnection, chunk: int) -> Evidence | None:
    """Evidence from a chained hop's own commitments (a client-mediated session has none)."""
    state = v.state
    commitments = state.commitments
    if not commitments.replies or commitments.opening is None or v.mine is None or v.reference is None:
        return None
    lengths = [x.shape[1] for x in state.replay.inputs]
    pieces, at = [], 0
    for k in range(v.first, len(lengths)):
        size = chunk if chunk > 0 else lengths[k]
        for begin in range(0, lengths[k], size):
            end = min(begin + size, lengths[k])
            pieces.append((k, begin, end, at + begin))
        at += lengths[k]
        if at >= v.mine.shape[1]:
            break
    found = _worst_piece(pieces, v.mine, v.reference, (state.hop.dtype,))
    if found is None:
        return None
    timeout = conn.timing.notice_timeout
    unsigned = conn.loop.run(seal_chains([state], timeout), timeout + 1.0)
    if unsigned or not state.commitments.audit():
        return None
    k, begin, end = found
    output = state.replay.outputs[k]
    if output is None:
        return None
    return _evidence(state, k, begin, end, output)


def _shadow_evidence(v: Verdict, conn: SwarmConnection) -> Evidence | None:
    shadow: Shadow | None = v.shadow
    if shadow is None or v.theirs is None or v.reference is None:
        return None
    pieces, at = [], -v.skip
    for k in range(v.shadow_first, len(shadow.state.replay.inputs)):
        n = shadow.state.replay.inputs[k].shape[1]
        pieces.append((k, 0, n, at))
        at += n
    found = _worst_piece(pieces, v.theirs, v.reference, (shadow.hop.dtype,))
    if found is None:
        return None
    timeout = conn.timing.notice_timeout
    if not conn.loop.run(shadow.seal(), timeout + 1.0):
        return None
    k, begin, end = found
    output = shadow.state.replay.outputs[k]
    return None if output is None else _evidence(shadow.state, k, begin, end, output)


def _evidence(state: HopState, step: int, begin: int, end: int, output: torch.Tensor) -> Evidence | None:
    if state.commitments.opening is None or state.commitments.chain.signed is None:
        return None
    _, length, signature = state.commitments.chain.signed
    dtype = getattr(torch, state.hop.dtype)
    starts = _starts([x.shape[1] for x in state.replay.inputs])
    context = [x.to(dtype) for x in state.replay.inputs[: step + 1]]
    output = output[:, begin:end]
    tail = state.replay.tails.get(step)
    if tail is not None and tail[1] is not None and end == state.replay.inputs[step].shape[1]:
        # the bad step's drafts were rejected: its commitment covers them too, input and output
        context[-1] = torch.cat([context[-1], tail[0].to(dtype)], dim=1)
        output = torch.cat([output, tail[1].to(output.dtype)], dim=1)
    tails = {starts[j]: t[0].to(dtype) for j, t in state.replay.tails.items() if j < step}
    try:
        return build(
            session_id=state.session_id,
            opening=state.commitments.opening,
            chain=state.commitments.replies[:length],
            signature=signature,
            context=torch.cat(context, dim=1),
            bad=starts[step] + begin,
            output=output.to(dtype),
            tails=tails,
        )
    except ValueError as e:  # a commitment that is no digest (a stale reply's): no evidence from this chain
        log.info("no evidence from this chain: %s", e, extra={"peer": state.hop.peer_id})
        return None
