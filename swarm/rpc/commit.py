"""Output commitments of chained inference: every server signs, for each step it runs, the digests of its input and
of its output, so that what a hop passed to the next one can be checked against what it told the client, then and
later (a signed commitment is evidence a third party can check; the authenticated stream it came over is not).

An Ed25519 key per server process signs commitments (about 60 µs each; the identity key is RSA, about 1 ms per
signature, too slow for every step). The identity key certifies it once, and the client checks that certificate
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


def digest(tensor: torch.Tensor) -> str:
    """sha-256 (hex) of a tensor's bytes as the receiver decodes them: its dtype's raw little-endian values."""
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def cert_message(commit_key: str, peer_id: str) -> bytes:
    return f"swarm-commit-key|{peer_id}|{commit_key}".encode()


def commit_message(reply: StepReply) -> bytes:
    return f"swarm-commit|{reply.position}|{reply.tag}|{reply.input_digest}|{reply.digest}".encode()


class CommitSigner:
    """A server's commitment key, and its certificate by the server's identity key."""

    def __init__(self, creds: Credentials) -> None:
        self._key = Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        self.opening = OpenReply(
            commit_key=raw, public_key=creds.public_key, commit_cert=creds.sign(cert_message(raw, creds.peer_id))
        )

    def reply(self, position: int, tag: int, hidden_in: torch.Tensor, out: torch.Tensor) -> StepReply:
        unsigned = StepReply(
            position=position, tag=tag, input_digest=digest(hidden_in), digest=digest(out), signature=""
        )
        return unsigned.model_copy(update={"signature": self._key.sign(commit_message(unsigned)).hex()})


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

    def verify(self, reply: StepReply) -> bool:
        try:
            self._key.verify(bytes.fromhex(reply.signature), commit_message(reply))
        except (InvalidSignature, ValueError):
            return False
        return True
