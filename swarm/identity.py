"""Who wrote a DHT value: the libp2p peer id of the RSA key that signed it.

Every party signs what it stores with its libp2p identity key (``swarm.dht`` generates one when ``--identity`` is
not given), under a subkey that names the key (hivemind's ``[owner:<ssh-rsa key>]`` marker, whose signature every
DHT node checks on store and every reader's node checks on get). A reader derives the peer id from that key, so a
record's ``peer_id`` (or holder, broker, trainer) is believed only when it names the key that signed it."""

from __future__ import annotations

import functools
import hashlib
import re
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.errors import BadInputError
from swarm.records import Record

R = TypeVar("R", bound=Record)

# The whole subkey must be one owner marker around one OpenSSH RSA key: hivemind signs with the first marker it finds
# anywhere in a subkey, so a looser match here would let "[owner:<victim's key>\n[owner:<own key>]" pass as the victim.
_OWNER = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/]+={0,2})\]")
_SHA256_MULTIHASH = b"\x12\x20"  # multihash code of sha2-256 and the digest length, 32


@functools.lru_cache(maxsize=4096)  # every read of the swarm meets the same few keys again
def peer_id_of_key(openssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key in OpenSSH form (as hivemind writes it into owner markers): the
    sha2-256 multihash of the key's libp2p protobuf, base58."""
    key = serialization.load_ssh_public_key(openssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded: bytes = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return str(base58.b58encode(_SHA256_MULTIHASH + hashlib.sha256(encoded).digest()).decode())


def owner_of(subkey: object) -> str | None:
    """The peer id whose key owns ``subkey`` (exactly one owner marker), or None: a value under any other subkey
    is stored unsigned, and nobody can say who wrote it."""
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.fullmatch(subkey)
    if found is None or subkey.count(b"[owner:") != 1:
        return None
    try:
        return peer_id_of_key(found.group(1))
    except ValueError:
        return None


def new_identity_file() -> Path:
    """A fresh libp2p identity (an RSA key) in a private temporary folder, for a peer or client started without
    ``--identity``: its DHT records are then signed by the key its libp2p peer id comes from."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-identity-"))
    path = folder / "identity.key"
    P2P.generate_identity(str(path))
    return path


class Signed(BaseModel):
    """A record as its author signed it, carried in a message (a step notice carries its trainer's progress): the
    receiver believes it without a DHT read, because the key that signed it is its author's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    public_key: str = Field(max_length=1024)  # OpenSSH form, as in hivemind's owner markers
    # the record's JSON: a chained route's hops take ~300 bytes each (id, session, addresses), so a route of the
    # dozens of small spans a swarm of consumer GPUs gives a model fits (4 KiB held 13: 24 hops of 2 blocks failed,
    # scripts/bench_scale.py at 50 peers); a server holds one per session, beside that session's KV cache
    payload: str = Field(max_length=64 * 1024)
    signature: str = Field(max_length=1024)  # base64, over the payload


def sign_record(key: RSAPrivateKey, record: Record) -> Signed:
    payload = record.model_dump_json()
    public = key.get_public_key().to_bytes().decode()
    return Signed(public_key=public, payload=payload, signature=key.sign(payload.encode()).decode())


def open_signed(signed: Signed, cls: type[R]) -> R:
    """The record inside ``signed`` if its signature holds and its author is the signing key's peer id; else a
    ``BadInputError`` saying why."""
    try:
        public_key = signed.public_key.encode()
        author = peer_id_of_key(public_key)
        valid = RSAPublicKey.from_bytes(public_key).verify(signed.payload.encode(), signed.signature.encode())
    except ValueError as e:
        raise BadInputError(f"signed record: unreadable key ({e})") from None
    if not valid:
        raise BadInputError("signed record: the signature does not match")
    try:
        record = cls.model_validate_json(signed.payload)
    except ValidationError as e:
        raise BadInputError(f"signed record: not a valid {cls.__name__} ({e.error_count()} problems)") from None
    if record.author != author:
        raise BadInputError(f"signed record: written as {record.author} but signed by {author}")
    return record


@dataclass
class Credentials:
    """Who this process is on the wire: its identity key, peer id, and (in a private swarm) its membership token."""

    key: RSAPrivateKey
    peer_id: str
    public_key: str  # OpenSSH form, as in hivemind's owner markers
    member: str | None = None
    _signed: OrderedDict[bytes, str] = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def of(cls, key: RSAPrivateKey, member: str | None = None) -> Credentials:
        public = key.get_public_key().to_bytes()
        return cls(key, peer_id_of_key(public), public.decode(), member)

    def sign(self, data: bytes) -> str:
        return str(self.key.sign(data).decode())

    def sign_once(self, data: bytes) -> str:
        """``sign``, cached for the last 1024 messages: an RSA signature costs about a millisecond, and a client signs
        the same connection proof for a server as long as that server keeps its certificate."""
        cached = self._signed.get(data)
        if cached is None:
            cached = self._signed[data] = self.sign(data)
            if len(self._signed) > 1024:
                self._signed.popitem(last=False)
        return cached
