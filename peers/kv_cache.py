"""KV-cache room under a token budget: a session reserves batch x max_length positions when it opens, waits a bounded
time for room, and is refused with a clear error rather than running the server out of memory. One caller may hold
only its share of the budget, so a single identity cannot take all of it (and an idle session gives its room back:
see ``peers.rpc.servicer``)."""

from __future__ import annotations

import asyncio
from collections import Counter

from swarm.errors import BusyError, CacheFullError


class CacheBudget:
    def __init__(self, total_tokens: int, per_caller: int | None = None) -> None:
        self.total = total_tokens
        self.per_caller = min(per_caller if per_caller is not None else total_tokens, total_tokens)
        self.used = 0
        self.held: Counter[str] = Counter()  # tokens reserved per caller
        self._changed = asyncio.Condition()

    @property
    def free(self) -> int:
        return self.total - self.used

    async def reserve(self, tokens: int, timeout: float, caller: str = "") -> int:
        if tokens > self.total:
            raise CacheFullError(
                f"a session of {tokens} cache tokens (batch x max_length) exceeds this server's whole budget "
                f"of {self.total} tokens"
            )
        if self._over_share(caller, tokens):  # refused at once: only the caller's own sessions can free its share
            raise BusyError(
                f"a session of {tokens} cache tokens would take this caller past its share of this server's KV "
                f"cache: it holds {self.held[caller]} of {self.per_caller} tokens (--caller-cache-share)"
            )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.free >= tokens), timeout)
            except TimeoutError:
                raise CacheFullError(
                    f"no KV-cache room: {tokens} tokens wanted, {self.free} of {self.total} free after {timeout:.1f} s"
                ) from None
            if self._over_share(caller, tokens):  # the caller's other sessions took it while this waited
                raise BusyError(f"this caller holds {self.held[caller]} of its {self.per_caller} KV-cache tokens")
            self.used += tokens
            self.held[caller] += tokens
        return tokens

    def _over_share(self, caller: str, tokens: int) -> bool:
        # a share of the whole budget is no share: then the caller waits for room like everyone
        return self.per_caller < self.total and self.held[caller] + tokens > self.per_caller

    async def release(self, tokens: int, caller: str = "") -> None:
        async with self._changed:
            self.used -= tokens
            self.held[caller] -= tokens
            if self.held[caller] <= 0:
                del self.held[caller]
            self._changed.notify_all()
