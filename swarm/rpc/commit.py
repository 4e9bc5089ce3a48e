"""Output commitments of chained inference: every server commits, for each step it runs, to the digests of its input
and of its output, so that what a hop passed to the next one can be checked against what it told the client, then
and later (a signed commitment is evidence a third party can check; the authenticated stream it came over is not).

The commitments of one session form a hash chain (``chain_start``, ``chain_next``): the chain's head after step k
binds every commitment up to k, in order. A server signs the head, not each commitment: on every ``SIGN_EVERY``-th
step's reply, and on every reply to a message without a step (a route update, and the client's ``seal`` when it
ends the session), so one signature covers all the steps before it. The client checks each step's digests as its
reply arrives (what chaining verifies on the decode path), folds each commitment into its own copy of the chain,
and checks one signature per hop, the latest, when a session ends or a hop is replaced.

An Ed25519 key per server process signs (about 60 µs a signature; the identity key is RSA, about 1 ms per
signature, too slow for the step path). The identity key certifies it once, and the client checks that certificate
once per hop, at the session's opening."""

from __future__ import annotations

import hashlib

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.utils.crypto import RSAPublicKey

from swarm.errors import BadInputError
from swarm.identity import Credentials, peer_id_of_key
from swarm.protocol import OpenReply, StepReply

SIGN_EVERY = 8  # a server signs its chain's head on every this many steps of a session (and on every route reply)


def digest(tensor: torch.Tensor) -> str:
    """sha-256 (hex) of a tensor's bytes as the receiver decodes them: its dtype's raw little-endian values."""
    data = tensor.detach().contiguous()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: its bytes through a byte view
        return hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().data).hexdigest()
    return hashlib.sha256(data.numpy().data).hexdigest()


def cert_message(commit_key: str, peer_id: str) -> bytes:
    return f"swarm-commit-key|{peer_id}|{commit_key}".encode()


def commit_message(reply: StepReply) -> bytes:
    return f"swarm-commit|{reply.position}|{reply.tag}|{reply.input_digest}|{reply.digest}|{reply.aux}".encode()


def binding(start: int, end: int, adapter: bool) -> str:
    """What a session's chain is bound to beside its id: the blocks it runs and whether an adapter changes them (so
    evidence cannot claim other blocks, or plain blocks where the client's adapter ran)."""
    return f"{start}:{end}|{'adapter' if adapter else '-'}"


def aux_digest(position: int, n: int, position_ids: torch.Tensor | None, mask: torch.Tensor | None) -> str:
    """ "" for a step at the default positions without a padding mask; else the sha-256 of the positions and mask it
    ran with (a commitment then says the step is not a plain prefix of the session: evidence needs it plain)."""
    plain = position_ids is None or torch.equal(
        position_ids.to(torch.int64), torch.arange(position, position + n).expand_as(position_ids)
    )
    unmasked = mask is None or bool((mask == 1).all())
    if plain and unmasked:
        return ""
    h = hashlib.sha256()
    for t in (position_ids, mask):
        if t is not None:
            h.update(t.detach().to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def chain_start(session_id: str, bound: str = "") -> bytes:
    """The head of a session's chain before its first commitment (``bound``: its ``binding``)."""
    return hashlib.sha256(f"swarm-commit-chain|{session_id}|{bound}".encode()).digest()


def chain_next(head: bytes, reply: StepReply) -> bytes:
    """The head once ``reply``'s commitment is added."""
    return hashlib.sha256(head + commit_message(reply)).digest()


def head_message(head: bytes, length: int) -> bytes:
    """What a signature over a chain of ``length`` commitments ending at ``head`` signs."""
    return f"swarm-commit-head|{length}|{head.hex()}".encode()


class _Chain:
    def __init__(self, session_id: str, bound: str) -> None:
        self.head = chain_start(session_id, bound)
        self.length = 0


class CommitSigner:
    """A server's commitment key, its certificate by the server's identity key, and the chain of each open session
    (keyed by ``session``: its caller and id; ``end`` forgets it)."""

    def __init__(self, creds: Credentials, sign_every: int = SIGN_EVERY) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.sign_every = sign_every
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        self.opening = OpenReply(
            commit_key=raw, public_key=creds.public_key, commit_cert=creds.sign(cert_message(raw, creds.peer_id))
        )
        self._chains: dict[tuple[str, str], _Chain] = {}

    def _chain(self, session: tuple[str, str], bound: str) -> _Chain:
        chain = self._chains.get(session)
        if chain is None:
            chain = self._chains[session] = _Chain(session[1], bound)
        return chain

    def _sign(self, chain: _Chain) -> str:
        return self._key.sign(head_message(chain.head, chain.length)).hex()

    def reply(
        self,
        session: tuple[str, str],
        position: int,
        tag: int,
        hidden_in: torch.Tensor | str,
        out: torch.Tensor,
        bound: str = "",
        aux: str = "",
    ) -> StepReply:
        """The commitment to one step of ``session`` (bound to ``bound``, at positions and mask ``aux``) that took in
        ``hidden_in`` (or what that digest names: a claimed piece's, ``swarm.rpc.claims``), added to its chain (and
        signed with the head every ``sign_every`` steps)."""
        chain = self._chain(session, bound)
        taken = hidden_in if isinstance(hidden_in, str) else digest(hidden_in)
        unsigned = StepReply(position=position, tag=tag, input_digest=taken, digest=digest(out), aux=aux, signature="")
        chain.head = chain_next(chain.head, unsigned)
        chain.length += 1
        if chain.length % self.sign_every:
            return unsigned
        return unsigned.model_copy(update={"signature": self._sign(chain)})

    def sealed(self, session: tuple[str, str], bound: str = "") -> OpenReply:
        """The answer to a message of ``session`` without a step: the certified key, and the signed head of the
        session's chain so far."""
        chain = self._chain(session, bound)
        if not chain.length:
            return self.opening  # nothing to sign yet (an opening)
        return self.opening.model_copy(update={"chain_length": chain.length, "chain_signature": self._sign(chain)})

    def end(self, session: tuple[str, str]) -> None:
        self._chains.pop(session, None)


class CommitKey:
    """The client's check of one server's commitments: built from its opening reply, refused unless the identity
    key of ``peer_id`` certified the commitment key."""

    def __init__(self, opening: OpenReply, peer_id: str) -> None:
        try:
            public = opening.public_key.encode()
            owner = peer_id_of_key(public)
            valid = RSAPublicKey.from_bytes(public).verify(
                cert_message(opening.commit_key, peer_id), opening.commit_cert.encode()
            )
            self._key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(opening.commit_key))
        except ValueError as e:
            raise BadInputError(f"peer {peer_id}: unreadable commitment key ({e})") from None
        if owner != peer_id or not valid:
            raise BadInputError(f"peer {peer_id}: its commitment key is not certified by its identity key")
        self.peer_id = peer_id

    def verify(self, head: bytes, length: int, signature: str) -> bool:
        """``signature`` signs the chain of ``length`` commitments that ends at ``head``."""
        try:
            self._key.verify(bytes.fromhex(signature), head_message(head, length))
        except (InvalidSignature, ValueError):
            return False
        return True


class ChainCopy:
    """The client's copy of one hop's chain: every commitment read from its stream, folded in order, and the latest
    signature the hop gave over it (checked by ``audit``)."""

    def __init__(self, session_id: str, bound: str = "") -> None:
        self.head = chain_start(session_id, bound)
        self.length = 0
        self.signed: tuple[bytes, int, str] | None = None  # (head, length, signature): the latest signed head
        self.verified = 0  # the chain's length up to which a signature was checked

    @property
    def signed_length(self) -> int:
        """How many of its commitments the latest signature covers."""
        return self.signed[1] if self.signed is not None else 0

    def fold(self, reply: StepReply) -> None:
        self.head = chain_next(self.head, reply)
        self.length += 1
        if reply.signature:
            self.signed = (self.head, self.length, reply.signature)

    def seal(self, opening: OpenReply) -> bool:
        """Take the signed head an answer without a step carries; False when it signs another length than this
        copy's (a chain the server and this side disagree on)."""
        if opening.chain_length != self.length:
            return False
        if opening.chain_signature:
            self.signed = (self.head, self.length, opening.chain_signature)
        return True

    def audit(self, key: CommitKey | None) -> bool:
        """Check the latest signature not yet checked; False if it does not hold (or there is no key to check it)."""
        if self.signed is None or self.signed[1] <= self.verified:
            return True
        head, length, signature = self.signed
        if key is None or not key.verify(head, length, signature):
            return False
        self.verified = length
        return True
