"""Private swarms: one shared secret (``--swarm-key FILE``) that every member holds and nobody else does.

p2pd offers no pre-shared-key (private network) option, so an outsider can still open a libp2p connection to a
member. What the key guards is everything said over it: every DHT request and response is signed with an HMAC under
the key (``SwarmKeyAuthorizer``), so a peer without it can neither join the DHT (its pings are refused) nor read or
write records, and a member believes no answer from outside; and ``token`` gives RPC handlers a membership proof
bound to the caller's libp2p peer id (which libp2p's handshake authenticates). HMAC, not RSA: a DHT lookup makes
many small calls, and every one is signed and checked."""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import hmac
import logging
import multiprocessing
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase

from swarm.errors import BadInputError

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 32  # shorter files are refused: a key is only as strong as its file's randomness
_TOKEN_DOMAIN = b"swarm-member-v1|"
# Distinct prefixes, so no signature made for one purpose (a token, a request, a response) passes for another.
_REQUEST_DOMAIN = b"swarm-dht-request-v1|"
_RESPONSE_DOMAIN = b"swarm-dht-response-v1|"


@dataclass(frozen=True)
class SwarmKey:
    """The swarm's secret: sha256 of the key file's contents (surrounding whitespace stripped, so a file copied
    through an editor or ``echo`` that added a newline is still the same key)."""

    secret: bytes = field(repr=False)  # never in logs or tracebacks
    path: Path | None = None

    def __post_init__(self) -> None:
        if len(self.secret) != 32:
            raise ValueError("a swarm key secret is 32 bytes")

    @classmethod
    def from_contents(cls, contents: bytes, path: Path | None = None) -> SwarmKey:
        contents = contents.strip()
        if len(contents) < MIN_KEY_BYTES:
            raise BadInputError(
                f"--swarm-key: the key in {path or 'the file'} is {len(contents)} bytes, fewer than "
                f"{MIN_KEY_BYTES}: use the file the swarm's first peer created"
            )
        return cls(hashlib.sha256(contents).digest(), path)

    @classmethod
    def load(cls, path: Path) -> SwarmKey:
        path = Path(path).expanduser()
        try:
            contents = path.read_bytes()
        except FileNotFoundError:
            raise BadInputError(
                f"--swarm-key: no key file at {path} (copy the swarm's key file there; only a peer starting a new "
                "swarm with --new-swarm creates one)"
            ) from None
        except OSError as e:  # a folder, no permission, ...
            raise BadInputError(f"--swarm-key: cannot read {path}: {e.strerror or e}") from None
        if path.stat().st_mode & 0o077:  # still usable, but anyone on this machine who can read it is a member
            log.warning("the swarm key file %s is readable by other users: chmod 600 it", path)
        return cls.from_contents(contents, path)

    @classmethod
    def create(cls, path: Path) -> SwarmKey:
        """A new random key written to ``path`` (as hex text, owner-only), which must not exist yet."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        text = secrets.token_hex(32).encode() + b"\n"
        try:  # O_EXCL: never overwrite a key others may already hold
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise BadInputError(f"--swarm-key: {path} already exists; not replacing it") from None
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        return cls.from_contents(text, path)

    @property
    def fingerprint(self) -> str:
        """A short public name for the key, to compare keys in logs without showing them."""
        return hashlib.sha256(b"swarm-key-fingerprint|" + self.secret).hexdigest()[:12]

    def mac(self, domain: bytes, data: bytes) -> bytes:
        return hmac.new(self.secret, domain + data, hashlib.sha256).digest()

    def token(self, peer_id: str) -> str:
        """The membership token of ``peer_id`` (base58): only a holder of the key can make it, and it is worthless
        to anyone else, since a handler compares it against the caller's authenticated peer id."""
        return self.mac(_TOKEN_DOMAIN, peer_id.encode()).hex()

    def admits(self, peer_id: str, token: str | None) -> bool:
        """Whether ``token`` is ``peer_id``'s membership (None: the caller sent none)."""
        if token is None:
            return False
        # bytes: compare_digest refuses non-ASCII str with a TypeError, and a token is hostile input
        return hmac.compare_digest(self.token(peer_id).encode(), token.encode(errors="replace"))


def swarm_key_for(path: Path | None, *, new_swarm: bool = False) -> SwarmKey | None:
    """The key ``--swarm-key`` names (None: an open swarm). The first peer of a new swarm creates a missing file;
    everyone else must be given the swarm's existing one."""
    if path is None:
        return None
    path = Path(path).expanduser()
    if new_swarm and not path.exists():
        key = SwarmKey.create(path)
        log.warning(
            "created a new swarm key at %s (key %s): give this file to every peer and client of the swarm",
            path,
            key.fingerprint,
        )
        return key
    return SwarmKey.load(path)


class _Auth(Protocol):
    """The ``auth`` field of hivemind's DHT requests and responses (protobuf, untyped there)."""

    signature: bytes
    nonce: bytes
    time: float


class _Descriptor(Protocol):
    full_name: str


class _Signed(Protocol):
    """A hivemind DHT request or response, as far as signing it goes."""

    DESCRIPTOR: _Descriptor
    auth: _Auth

    def SerializeToString(self, *, deterministic: bool = ...) -> bytes: ...


def _signable(domain: bytes, message: _Signed) -> bytes:
    """What is signed: the message's type and its bytes with ``auth.signature`` empty (as hivemind's authorizers do).
    Deterministic serialization: sender and receiver must produce the same bytes."""
    kind: str = message.DESCRIPTOR.full_name
    body: bytes = message.SerializeToString(deterministic=True)
    return domain + kind.encode() + b"|" + body


class SwarmKeyAuthorizer(AuthorizerBase):  # type: ignore[misc]  # hivemind ships no type information
    """Signs and checks every DHT request and response with the swarm key (hivemind calls it in the DHT's own
    process: a request that fails ``validate_request`` gets no answer, a response that fails ``validate_response``
    counts as none).

    Requests carry their time and a random nonce: a request more than ``max_skew`` seconds off is refused, and so
    is a nonce seen before. The nonces are kept at most ``max_nonces`` at once; when that bound evicts one early, every
    request no newer than it is refused from then on, so a replay is never accepted because its nonce was forgotten."""

    def __init__(self, key: SwarmKey, max_skew: float = 60.0, max_nonces: int = 1 << 16) -> None:
        self.key = key
        self.max_skew = max_skew
        self.max_nonces = max_nonces
        self._nonces: set[bytes] = set()
        self._expiries: list[tuple[float, bytes]] = []  # a heap of (request time, nonce)
        self._floor = float("-inf")
        # Answers without a signature (from an open swarm's peers) the DHT process saw, in shared memory: the process
        # that started the DHT (whose child was forked after this was made) reads it to say why joining failed.
        self._unsigned = multiprocessing.RawValue(ctypes.c_int, 0)

    @property
    def unsigned_answers(self) -> int:
        return int(self._unsigned.value)

    def _sign(self, domain: bytes, message: _Signed) -> None:
        message.auth.signature = b""
        message.auth.signature = self.key.mac(domain, _signable(domain, message))

    def _verify(self, domain: bytes, message: _Signed) -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self.key.mac(domain, _signable(domain, message)))
        finally:
            message.auth.signature = signature

    async def sign_request(self, request: _Signed, service_public_key: object) -> None:
        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(16)
        self._sign(_REQUEST_DOMAIN, request)

    async def validate_request(self, request: _Signed) -> bool:
        if not self._verify(_REQUEST_DOMAIN, request):
            log.debug("refused a DHT request not signed with this swarm's key")
            return False
        now, sent, nonce = float(get_dht_time()), float(request.auth.time), bytes(request.auth.nonce)
        if abs(sent - now) > self.max_skew:
            log.debug("refused a DHT request %.0f s off this peer's clock", sent - now)
            return False
        while self._expiries and self._expiries[0][0] < now - self.max_skew:  # too old to pass the time check
            self._nonces.discard(heapq.heappop(self._expiries)[1])
        if sent <= self._floor or nonce in self._nonces:
            log.debug("refused a replayed DHT request")
            return False
        if len(self._expiries) >= self.max_nonces:
            oldest, forgotten = heapq.heappop(self._expiries)
            self._nonces.discard(forgotten)
            self._floor = max(self._floor, oldest)
        self._nonces.add(nonce)
        heapq.heappush(self._expiries, (sent, nonce))
        return True

    async def sign_response(self, response: _Signed, request: _Signed) -> None:
        response.auth.nonce = request.auth.nonce  # binds the answer to its question
        self._sign(_RESPONSE_DOMAIN, response)

    async def validate_response(self, response: _Signed, request: _Signed) -> bool:
        if not response.auth.signature:
            self._unsigned.value += 1
            log.debug("a DHT answer carries no swarm key signature (the peer runs an open swarm)")
            return False
        return self._verify(_RESPONSE_DOMAIN, response) and bool(response.auth.nonce == request.auth.nonce)
