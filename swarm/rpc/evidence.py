"""Evidence of a wrong answer (``swarm.accusations``): built by the client that caught it from what the server
signed, and checked by anyone before they re-run it. A check proves that the accused committed, under the key its
identity certified, in a session bound to the accusation's blocks without an adapter, to the given output for the
given context at the default positions; whether that output is wrong is for the re-run.

The context is what the server's cache held when it ran the bad step: its commitments are replayed as the server
runs steps (each appends at the cache's end, or redoes from where an earlier step began, dropping what came after),
and the pieces must be exactly the commitments left standing, so a context stitched from a step and the one that
replaced it proves nothing. A step undone from inside (a speculative step's rejected drafts) stands for the positions
before the next step's start; what it took in beyond them is carried as the piece's tail, so its digest is checked,
and is not part of the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.accusations import MAX_COMMITMENTS, MAX_EVIDENCE_BYTES, Commitment, Evidence, Piece, TensorBlob
from swarm.errors import BadInputError
from swarm.protocol import OpenReply, StepReply
from swarm.rpc.claims import claimed_length, input_digest
from swarm.rpc.commit import CommitKey, binding, chain_next, chain_start, digest


@dataclass(frozen=True)
class Facts:
    """What checked evidence proves the accused committed to: ``output`` for positions ``offset:`` of ``inputs``."""

    inputs: torch.Tensor  # [batch, offset + n, hidden]: the context, position 0 on
    output: torch.Tensor  # [batch, n, hidden]
    offset: int


def _reply(c: Commitment) -> StepReply:
    return StepReply(position=c.position, tag=c.tag, input_digest=c.input_digest, digest=c.digest, aux=c.aux)


def standing(positions: list[int]) -> list[tuple[int, int]]:
    """(index, position) of the commitments whose steps a server's cache holds after running them in order: each
    step appends at ``position``, dropping every earlier step from ``position`` on (a redo)."""
    alive: list[tuple[int, int]] = []
    for i, p in enumerate(positions):
        while alive and alive[-1][1] >= p:
            alive.pop()
        alive.append((i, p))
    return alive


def check(evidence: Evidence, accused: str, start: int, end: int) -> Facts:
    """The facts ``evidence`` proves about ``accused`` serving blocks ``start:end``; ``BadInputError`` saying why it
    proves nothing (any malformed part of it included)."""
    try:
        return _check(evidence, accused, start, end)
    except BadInputError:
        raise
    except Exception as e:  # noqa: BLE001 - hostile evidence: whatever it breaks, it proves nothing
        raise BadInputError(f"malformed evidence: {type(e).__name__}: {e}") from None


def _check(evidence: Evidence, accused: str, start: int, end: int) -> Facts:
    e = evidence
    key = CommitKey(OpenReply(commit_key=e.commit_key, public_key=e.public_key, commit_cert=e.commit_cert), accused)
    head = chain_start(e.session_id, binding(start, end, False))
    for c in e.commitments:
        head = chain_next(head, _reply(c))
    if not key.verify(head, len(e.commitments), e.signature):
        raise BadInputError("the signature does not cover these commitments, for these blocks without an adapter")
    try:
        inputs, output = e.inputs.tensor(), e.output.tensor()
    except ValueError as err:
        raise BadInputError(f"malformed tensors: {err}") from None
    if inputs.dtype != output.dtype or inputs.shape[0] != output.shape[0] or inputs.shape[2] != output.shape[2]:
        raise BadInputError("inputs and output do not match in dtype, batch or width")
    try:
        tails = e.tails.tensor() if e.tails is not None else inputs[:, :0]
    except ValueError as err:
        raise BadInputError(f"malformed tails: {err}") from None
    if tails.dtype != inputs.dtype or tails.shape[0] != inputs.shape[0] or tails.shape[2] != inputs.shape[2]:
        raise BadInputError("tails and inputs do not match in dtype, batch or width")
    if inputs.nbytes + output.nbytes + tails.nbytes > MAX_EVIDENCE_BYTES:
        raise BadInputError("evidence tensors over the size limit")
    bad = e.pieces[-1]
    if bad.index >= len(e.commitments):
        raise BadInputError("a piece outside the chain")
    alive = standing([c.position for c in e.commitments[: bad.index + 1]])
    if [(p.index, p.start) for p in e.pieces] != alive:
        raise BadInputError("the pieces are not the steps the server's cache held at the bad step")
    expected, taken = 0, 0
    if bad.tail:
        raise BadInputError("the bad step's whole input belongs in the context")
    for piece in e.pieces:
        c = e.commitments[piece.index]
        if c.aux and (claimed_length(c.aux) is None or piece.tail):
            raise BadInputError("a step ran at other positions or with a mask: not re-runnable as a plain prefix")
        part = inputs[:, piece.start : piece.start + piece.length]
        tail = tails[:, taken : taken + piece.tail]
        taken += piece.tail
        whole = torch.cat([part, tail], dim=1) if piece.tail else part
        if (
            piece.start != expected
            or part.shape[1] != piece.length
            or tail.shape[1] != piece.tail
            or input_digest(inputs, piece.start, whole, c.aux) != c.input_digest
        ):
            raise BadInputError(f"the context at {piece.start} is not what commitment {piece.index} took in")
        expected = piece.start + piece.length
    if taken != tails.shape[1]:
        raise BadInputError("tails beyond the pieces'")
    if (
        expected != inputs.shape[1]
        or output.shape[1] != bad.length
        or digest(output) != e.commitments[bad.index].digest
    ):
        raise BadInputError("the output is not what the last piece's commitment gave out")
    return Facts(inputs, output, bad.start)


def build(
    *,
    session_id: str,
    opening: OpenReply,
    chain: list[StepReply],
    signature: str,
    context: torch.Tensor,
    bad: int,
    output: torch.Tensor,
    tails: dict[int, torch.Tensor] | None = None,
) -> Evidence | None:
    """Evidence that the server of ``chain`` (its commitments, oldest first, all covered by ``signature``) gave
    ``output`` (in its dtype) for the step at position ``bad`` of ``context`` (what it took in from position 0, in
    its dtype). ``tails``: by a step's start, what it took in beyond what stood of it (its rejected drafts). None
    where its commitments do not bind it (no such step, a context it did not take in, other positions or a mask) or
    it is too large to publish."""
    tails = tails or {}
    if len(chain) > MAX_COMMITMENTS:
        return None
    want = digest(output)
    index = next(
        (i for i in range(len(chain) - 1, -1, -1) if chain[i].position == bad and chain[i].digest == want), None
    )
    if index is None:
        return None
    end = bad + output.shape[1]
    context = context[:, :end].contiguous()
    if context.shape[1] != end:
        return None
    alive = standing([c.position for c in chain[: index + 1]])
    pieces: list[Piece] = []
    carried: list[torch.Tensor] = []
    for k, (i, start) in enumerate(alive):
        stop = alive[k + 1][1] if k + 1 < len(alive) else end
        part = context[:, start:stop]
        aux = chain[i].aux
        if aux and claimed_length(aux) is None:  # (a claimed piece binds its input through the claimed positions)
            return None
        tail = None
        if input_digest(context, start, part, aux) != chain[i].input_digest:  # undone from inside: its tail
            tail = tails.get(start) if k + 1 < len(alive) and not aux else None
            whole = torch.cat([part, tail.to(part.dtype)], dim=1) if tail is not None else part
            if tail is None or digest(whole) != chain[i].input_digest:
                return None
            carried.append(tail.to(part.dtype))
        pieces.append(Piece(index=i, start=start, length=stop - start, tail=0 if tail is None else tail.shape[1]))
    blob = torch.cat(carried, dim=1).contiguous() if carried else None
    if context.nbytes + output.nbytes + (blob.nbytes if blob is not None else 0) > MAX_EVIDENCE_BYTES:
        return None
    return Evidence(
        session_id=session_id,
        commit_key=opening.commit_key,
        public_key=opening.public_key,
        commit_cert=opening.commit_cert,
        commitments=tuple(
            Commitment(position=c.position, tag=c.tag, input_digest=c.input_digest, digest=c.digest, aux=c.aux)
            for c in chain
        ),
        signature=signature,
        pieces=tuple(pieces),
        inputs=TensorBlob.of(context),
        output=TensorBlob.of(output),
        tails=TensorBlob.of(blob) if blob is not None else None,
    )


def facts_or_none(evidence: Evidence, accused: str, start: int, end: int) -> tuple[Facts | None, str]:
    try:
        return check(evidence, accused, start, end), ""
    except BadInputError as e:
        return None, str(e)
