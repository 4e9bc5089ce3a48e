"""Acting on verification verdicts (``swarm.client.verify``), on the session's thread between steps: the cheater is
banned, a cheating hop is replaced at the next step, and the evidence its signed commitments give is published as
an accusation (``swarm.client.trust``). Evidence needs the cheater's signature over the bad step's commitment: it is
asked to sign its chain's head first (the seal every session ends with); one that will not sign is still banned."""

from __future__ import annotations

import itertools
import logging

import torch

from swarm.accusations import ACCUSATION_TTL, Evidence
from swarm.client.chain import Chain, HopState
from swarm.client.connection import SwarmConnection
from swarm.client.verify import Verdict
from swarm.rpc.evidence import build

log = logging.getLogger(__name__)


def act(verdicts: list[Verdict], conn: SwarmConnection, chunk: int) -> list[str]:
    """Ban, replace and accuse as ``verdicts`` say; the peers caught cheating."""
    caught: list[str] = []
    for v in verdicts:
        if v.who == "unresolved" and v.comparison is not None:
            v.state.broken = True  # two servers disagree and nothing decides: move off the hop, blaming nobody
        cheater = v.cheater
        if cheater is not None:
            caught.append(cheater)
            evidence = _hop_evidence(v, conn, chunk) if v.who == "hop" else _shadow_evidence(v, conn)
            conn.view.ban(cheater, ACCUSATION_TTL)
            conn.retrier.failovers += 1
            if v.who == "hop":
                v.state.broken = True  # replaced at the next step, its history replayed onto another server
            log.warning(
                "caught a server computing wrong answers: %s",
                v.reason,
                extra={"peer": cheater, "span": f"{v.state.hop.start}:{v.state.hop.end}"},
            )
            if evidence is not None and conn.trust is not None and conn.cfg.accuse:
                hop = v.state.hop if v.who == "hop" else v.shadow.hop if v.shadow is not None else v.state.hop
                conn.trust.accuse(cheater, hop, evidence, v.reason)
        if v.who in ("verifier", "unresolved") and v.shadow is not None:
            v.shadow.close()
    return caught


def _starts(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)][:-1]


def _hop_evidence(v: Verdict, conn: SwarmConnection, chunk: int) -> Evidence | None:
    """Evidence from a chained hop's own commitments (a client-mediated session has none)."""
    state = v.state
    output = state.outputs[v.entry] if v.entry < len(state.outputs) else None
    if not state.commitments or state.opening is None or output is None:
        return None
    timeout = conn.timing.notice_timeout
    try:
        unsigned = conn.loop.run(Chain.seal([state], timeout), timeout + 1.0)
    except Exception as e:  # noqa: BLE001 - no signature, no evidence; the ban stands
        log.info("the cheater did not sign its chain: %s", e, extra={"peer": state.hop.peer_id})
        return None
    if unsigned or not state.chain.audit(state.commit) or state.chain.signed is None:
        return None
    return _evidence(state, chunk, v.entry, v.offset, output)


def _shadow_evidence(v: Verdict, conn: SwarmConnection) -> Evidence | None:
    shadow = v.shadow
    if shadow is None:
        return None
    timeout = conn.timing.notice_timeout
    try:
        signed = conn.loop.run(shadow.seal(), timeout + 1.0)
    except Exception:  # noqa: BLE001 - no signature, no evidence; the ban stands
        return None
    output = shadow.state.outputs[v.shadow_entry] if v.shadow_entry < len(shadow.state.outputs) else None
    if not signed or output is None:
        return None
    return _evidence(shadow.state, 0, v.shadow_entry, 0, output)


def _evidence(state: HopState, chunk: int, entry: int, offset: int, output: torch.Tensor) -> Evidence | None:
    assert state.opening is not None and state.chain.signed is not None
    _, length, signature = state.chain.signed
    dtype = getattr(torch, state.hop.dtype)
    lengths = [x.shape[1] for x in state.inputs]
    starts = _starts(lengths)
    size = chunk if chunk > 0 else lengths[entry]
    begin = (offset // size) * size  # the piece of the step that holds the worst position
    end = min(begin + size, lengths[entry])
    return build(
        session_id=state.session_id,
        opening=state.opening,
        chain=state.commitments[:length],
        signature=signature,
        steps=[(starts[i], state.inputs[i].to(dtype)) for i in range(entry + 1)],
        chunk=chunk,
        bad=starts[entry] + begin,
        output=output[:, begin:end].to(dtype),
    )
