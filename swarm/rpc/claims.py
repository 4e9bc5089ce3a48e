"""Prefix claims: a client that knows a server kept the start of a session's first input (``peers.serving.prefixes``)
names it by its digest instead of sending it, so a long prompt's shared part crosses the first link once.

Servers key kept prefixes by a chain of sha-256 digests of the inputs they received, one every ``BLOCK`` positions
(``digest k`` = sha-256 of digest k-1 and block k's bytes as the server decoded them). The first hop's input is the
client's own (its embeddings, as the wire delivers them), so the client can work the same chain out and remember
it. A session's first step may then claim its first ``length`` positions (``swarm.protocol.PrefixClaim``: the chain's
digest there): the client sends them as pieces without tensors, each naming the claim and its end, and the rest as
usual. The server answers and passes on each claimed piece from its kept prefix of exactly those inputs, as if it
had been sent: every message stays the size of a piece. A claim the server cannot honour (evicted, another caller's,
another input) is refused (``PrefixUnknownError``), and the client sends the step whole.

A claimed piece's commitment still binds its input: its input digest is ``piece_digest`` (the chain's digest at
``length`` and the piece's positions) and its ``aux`` says ``claim_aux(length)``, so evidence whose context holds
the claimed positions checks (``swarm.rpc.evidence``), and nobody can swap them for other rows."""

from __future__ import annotations

import hashlib

import torch

from swarm.rpc.commit import digest

BLOCK = 64  # positions per digest of a kept prefix: what a reuse, and a claim, is rounded down to
_AUX = "claim:"


def block_digests(previous: bytes, hidden: torch.Tensor) -> list[bytes]:
    """The chained digests of ``hidden``'s [batch, n, hidden] whole blocks of positions, after ``previous``."""
    out: list[bytes] = []
    data = hidden.detach()
    for at in range(0, data.shape[1] - BLOCK + 1, BLOCK):
        block = data[:, at : at + BLOCK].contiguous()
        raw = block.reshape(-1).view(torch.uint8) if block.dtype == torch.bfloat16 else block
        previous = hashlib.sha256(previous + raw.numpy().tobytes()).digest()
        out.append(previous)
    return out


def claim_aux(length: int) -> str:
    """A claimed piece's ``aux`` in its commitment (claims are only made for steps at default positions, unmasked)."""
    return f"{_AUX}{length}"


def claimed_length(aux: str) -> int | None:
    """The positions claimed with a commitment's piece (None: not a claimed piece)."""
    if not aux.startswith(_AUX) or not aux[len(_AUX) :].isdigit():
        return None
    return int(aux[len(_AUX) :])


def piece_digest(prefix: bytes, start: int, end: int) -> str:
    """The input digest of a claimed piece ``start:end`` of the claim whose chain ends at ``prefix``."""
    return hashlib.sha256(b"swarm-claim|" + prefix + f"|{start}|{end}".encode()).hexdigest()


def input_digest(context: torch.Tensor, start: int, whole: torch.Tensor, aux: str) -> str:
    """What a commitment with ``aux`` to a step at ``start`` that took in ``whole`` says of its input, where
    ``context`` holds the session's inputs from position 0 ("" where it cannot say: a claimed piece whose claim
    reaches past the context)."""
    length = claimed_length(aux)
    if length is None:
        return digest(whole)
    chain = block_digests(b"", context[:, :length])
    if not length or len(chain) * BLOCK != length or start + whole.shape[1] > length:
        return ""
    return piece_digest(chain[-1], start, start + whole.shape[1])
