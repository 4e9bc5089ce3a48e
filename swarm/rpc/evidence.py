"""Evidence of a wrong answer (``swarm.accusations``): built by the client that caught it from what the server
signed, and checked by anyone before they re-run it. A check proves that the accused committed, under the key its
identity certified, to the given output for the given context; whether that output is wrong is for the re-run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.accusations import MAX_COMMITMENTS, MAX_EVIDENCE_BYTES, Commitment, Evidence, Piece, TensorBlob
from swarm.errors import BadInputError
from swarm.protocol import OpenReply, StepReply
from swarm.rpc.commit import CommitKey, chain_next, chain_start, digest


@dataclass(frozen=True)
class Facts:
    """What checked evidence proves the accused committed to: ``output`` for positions ``offset:`` of ``inputs``."""

    inputs: torch.Tensor  # [batch, offset + n, hidden]: the context, position 0 on
    output: torch.Tensor  # [batch, n, hidden]
    offset: int


def _reply(c: Commitment) -> StepReply:
    return StepReply(position=c.position, tag=c.tag, input_digest=c.input_digest, digest=c.digest)


def check(evidence: Evidence, accused: str) -> Facts:
    """The facts ``evidence`` proves about ``accused``; ``BadInputError`` saying why it proves nothing."""
    e = evidence
    opening = OpenReply(commit_key=e.commit_key, public_key=e.public_key, commit_cert=e.commit_cert)
    key = CommitKey(opening, accused)  # raises unless the accused's identity certified the key
    head = chain_start(evidence.session_id)
    for c in evidence.commitments:
        head = chain_next(head, _reply(c))
    if not key.verify(head, len(evidence.commitments), evidence.signature):
        raise BadInputError("the signature does not cover these commitments")
    try:
        inputs, output = evidence.inputs.tensor(), evidence.output.tensor()
    except ValueError as e:
        raise BadInputError(f"malformed tensors: {e}") from None
    if inputs.dtype != output.dtype or inputs.shape[0] != output.shape[0] or inputs.shape[2] != output.shape[2]:
        raise BadInputError("inputs and output do not match in dtype, batch or width")
    if inputs.nbytes + output.nbytes > MAX_EVIDENCE_BYTES:
        raise BadInputError("evidence tensors over the size limit")
    expected, last = 0, -1
    for piece in evidence.pieces:
        if piece.index <= last or piece.index >= len(evidence.commitments):
            raise BadInputError("pieces out of the chain's order")
        c = evidence.commitments[piece.index]
        if piece.start != expected or c.position != piece.start:
            raise BadInputError("pieces do not tile the context from position 0")
        part = inputs[:, piece.start : piece.start + piece.length]
        if part.shape[1] != piece.length or digest(part) != c.input_digest:
            raise BadInputError(f"the context at {piece.start} is not what commitment {piece.index} took in")
        expected, last = piece.start + piece.length, piece.index
    bad, bad_commitment = evidence.pieces[-1], evidence.commitments[evidence.pieces[-1].index]
    if expected != inputs.shape[1] or output.shape[1] != bad.length or digest(output) != bad_commitment.digest:
        raise BadInputError("the output is not what the last piece's commitment gave out")
    return Facts(inputs, output, bad.start)


def build(
    *,
    session_id: str,
    opening: OpenReply,
    chain: list[StepReply],
    signature: str,
    steps: list[tuple[int, torch.Tensor]],
    chunk: int,
    bad: int,
    output: torch.Tensor,
) -> Evidence | None:
    """Evidence that the server of ``chain`` (its commitments, oldest first, all covered by ``signature``) gave
    ``output`` for positions ``bad:bad + n`` of the context ``steps`` ((position, input) for each step, in the
    server's dtype, cut in ``chunk``-token pieces as they were sent; 0: whole). None where its commitments do not
    bind it (a piece no commitment matches) or it is too large to publish."""
    context = torch.cat([x for _, x in steps], dim=1)
    end = bad + output.shape[1]
    if context.shape[1] < end or len(chain) > MAX_COMMITMENTS:
        return None
    context = context[:, :end].contiguous()
    if context.nbytes + output.nbytes > MAX_EVIDENCE_BYTES:
        return None
    pieces: list[Piece] = []
    floor = -1
    for position, x in steps:
        n = x.shape[1]
        size = chunk if chunk > 0 else n
        for s in range(0, n, size):
            start, length = position + s, min(size, n - s)
            if start >= end:
                break
            if start + length > end:  # the bad piece ends the context
                length = end - start
            want = digest(context[:, start : start + length])
            index = _latest(chain, start, want, floor)
            if index is None:
                return None
            pieces.append(Piece(index=index, start=start, length=length))
            floor = index
    if not pieces or pieces[-1].start != bad or chain[pieces[-1].index].digest != digest(output):
        return None
    return Evidence(
        session_id=session_id,
        commit_key=opening.commit_key,
        public_key=opening.public_key,
        commit_cert=opening.commit_cert,
        commitments=tuple(
            Commitment(position=c.position, tag=c.tag, input_digest=c.input_digest, digest=c.digest) for c in chain
        ),
        signature=signature,
        pieces=tuple(pieces),
        inputs=TensorBlob.of(context),
        output=TensorBlob.of(output),
    )


def _latest(chain: list[StepReply], position: int, input_digest: str, floor: int) -> int | None:
    """The latest commitment after ``floor`` at ``position`` that took in ``input_digest`` (a retried step leaves
    earlier ones; the server's cache holds the last)."""
    for i in range(len(chain) - 1, floor, -1):
        c = chain[i]
        if c.position == position and c.input_digest == input_digest:
            return i
    return None


def facts_or_none(evidence: Evidence, accused: str) -> tuple[Facts | None, str]:
    try:
        return check(evidence, accused), ""
    except BadInputError as e:
        return None, str(e)
