"""Inference sessions kept open between one caller's requests, so a conversation's next turn sends and computes only
what is new.

OpenAI clients send a chat's whole history with every turn; without this each turn opened a session and computed
that history again on every server (its prefill, and its hidden states across every hop). Here the session an
answer ran in stays open on the servers after the reply, holding the KV of the prompt and of the answer's tokens the
servers saw; a later request of the same caller whose prompt starts with exactly those tokens continues it, sending
only the rest. The servers' results are the session's own (a continued session is what a longer generation is), so
failover, verification and batching work as for any session; the usage reports the reused tokens as OpenAI's API
does (``prompt_tokens_details.cached_tokens``).

Private: a caller's sessions are reused by that caller only (its API key; without keys, its address), so nobody
learns by timing what another asked. Bounded: ``per_caller`` kept sessions each, ``total`` in all, and at most
``room()`` tokens of KV room held by them together (least recently used first out), each closed after ``idle``
seconds unused, before the servers' own idle limit ends it (``Timing.session_idle``). A kept session holds its
servers' KV room, counted against this API's share there (so ``room`` is a quarter of the smallest server's
budget: half the share a caller has by default, the other half left to live requests), and is opened with room for
the conversation to double (at least ``headroom`` tokens beyond its first request's need), so the next turns fit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.client.session.inference_session import InferenceSession


@dataclass
class Kept:
    session: InferenceSession
    tokens: list[int]  # what the servers hold, in order (the prompt, then the answer's tokens they were sent)
    used: float  # when it was last given back (the clock's time)


@dataclass
class Conversations:
    per_caller: int = 2
    total: int = 32
    idle: float = 30.0
    headroom: int = 512
    # tokens of KV room (batch x max_length) all kept sessions may hold at once: they hold it on their servers, in
    # this API's share there, which live requests need too (``ServedModel``: a quarter of the smallest server's)
    room: Callable[[], int] = lambda: 1 << 62
    clock: Callable[[], float] = time.monotonic
    _kept: dict[str, list[Kept]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def enabled(self) -> bool:
        return self.per_caller > 0 and self.total > 0

    def take(self, caller: str, prompt: list[int], need: int) -> tuple[InferenceSession, int] | None:
        """The caller's kept session whose tokens are the longest proper prefix of ``prompt`` with room for ``need``
        more tokens after it, taken out (one request at a time uses it), and how many tokens it holds; None if none."""
        if not self.enabled:
            return None
        stale = self._expire()
        best: Kept | None = None
        with self._lock:
            mine = self._kept.get(caller, [])
            for k in list(mine):
                n = len(k.tokens)
                if not (n < len(prompt) and prompt[:n] == k.tokens) or k.session.closed:
                    continue
                if len(prompt) + need > k.session.max_length:  # outgrown: closed now, so that the servers keep its
                    mine.remove(k)  # prefix (``peers.serving.prefixes``) for the larger session this request opens
                    stale.append(k.session)
                elif best is None or n > len(best.tokens):
                    best = k
            if best is not None:
                mine.remove(best)
        _close(stale)
        return (best.session, len(best.tokens)) if best is not None else None

    def give(self, caller: str, session: InferenceSession, tokens: list[int]) -> None:
        """Keep ``session`` (holding ``tokens``) for the caller's next turn; the least recently used go over the
        limits."""
        if not self.enabled or session.closed or session.position != len(tokens):
            _close([session])
            return
        stale = self._expire()
        room = self.room()  # (outside the lock: it may read the swarm's records)
        with self._lock:
            mine = self._kept.setdefault(caller, [])
            mine.append(Kept(session, list(tokens), self.clock()))
            while len(mine) > self.per_caller:
                stale.append(mine.pop(0).session)
            while self._kept and (self._count() > self.total or self._tokens() > room):
                oldest = min((k for v in self._kept.values() for k in v), key=lambda k: k.used)
                self._kept[_owner(self._kept, oldest)].remove(oldest)
                self._kept = {c: v for c, v in self._kept.items() if v}
                stale.append(oldest.session)
            self._kept = {c: v for c, v in self._kept.items() if v}
        _close(stale)

    def _count(self) -> int:
        return sum(len(v) for v in self._kept.values())

    def _tokens(self) -> int:
        return sum(k.session.max_length * k.session.batch_size for v in self._kept.values() for k in v)

    def expire(self) -> None:
        """Close the sessions unused for ``idle`` seconds (the API calls it every half second)."""
        _close(self._expire())

    def held(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._kept.values())

    def close(self) -> None:
        with self._lock:
            sessions = [k.session for v in self._kept.values() for k in v]
            self._kept = {}
        _close(sessions)

    def _expire(self) -> list[InferenceSession]:
        """Take out the sessions unused for ``idle`` seconds (closed by the caller, outside the lock)."""
        now = self.clock()
        out = []
        with self._lock:
            for caller, kept in self._kept.items():
                old = [k for k in kept if now - k.used > self.idle]
                out += [k.session for k in old]
                self._kept[caller] = [k for k in kept if k not in old]
            self._kept = {c: v for c, v in self._kept.items() if v}
        return out


def _owner(kept: dict[str, list[Kept]], item: Kept) -> str:
    return next(c for c, v in kept.items() if item in v)


def _close(sessions: list[InferenceSession]) -> None:
    for session in sessions:
        session.close()  # frees the servers' caches now
