"""Who holds a key of an HTTP server that requires one (the API's ``--api-key``): a caller shows it in an
``Authorization: Bearer KEY`` header (programs, and the API's ``/v1`` routes accept nothing else), or, for a browser,
once in the dashboard's login form, after which an HttpOnly, SameSite=Strict cookie carries a token derived from the
key (an HMAC under a secret drawn at start, so the cookie is worth nothing to another process or after a restart, and
never is the key itself). Keys are compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

COOKIE = "swarm_dashboard"


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header ("" if it is not one)."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""


class Access:
    """The keys of one server (none: everyone may everything) and the dashboard cookies they open."""

    def __init__(self, keys: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self._secret = secrets.token_bytes(32)
        self._tokens = tuple(self._token(k) for k in keys)

    @property
    def open(self) -> bool:
        return not self.keys

    def _token(self, key: str) -> str:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def key_of(self, given: str) -> str | None:
        """``given`` if it is one of the keys, else None (every key compared, in constant time)."""
        hit = False
        for k in self.keys:
            hit |= hmac.compare_digest(given.encode(), k.encode())
        return given if hit and given else None

    def header_key(self, headers: Mapping[str, str]) -> str | None:
        """The valid key in the request's ``Authorization`` header, or None."""
        return self.key_of(bearer(headers.get("authorization", "")))

    def cookie_for(self, key: str) -> str | None:
        """The dashboard cookie's value for a valid ``key`` (None for anything else)."""
        return self._token(key) if self.key_of(key) is not None else None

    def allows(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> bool:
        """Whether a request is a key holder's: no keys are required, or a valid key is in its header, or a valid
        dashboard cookie is with it."""
        if self.open or self.header_key(headers) is not None:
            return True
        given = cookies.get(COOKIE, "").encode()
        hit = False
        for t in self._tokens:
            hit |= hmac.compare_digest(given, t.encode())
        return hit
