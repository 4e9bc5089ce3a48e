"""KV-cache room under a token budget: a session reserves batch x max_length positions when it opens, waits a bounded
time for room, and is refused with a clear error rather than running the server out of memory."""

from __future__ import annotations

import asyncio

from swarm.errors import CacheFullError


class CacheBudget:
    def __init__(self, total_tokens: int) -> None:
        self.total = total_tokens
        self.used = 0
        self._changed = asyncio.Condition()

    @property
    def free(self) -> int:
        return self.total - self.used

    async def reserve(self, tokens: int, timeout: float) -> int:
        if tokens > self.total:
            raise CacheFullError(
                f"a session of {tokens} cache tokens (batch x max_length) exceeds this server's whole budget "
                f"of {self.total} tokens"
            )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.free >= tokens), timeout)
            except TimeoutError:
                raise CacheFullError(
                    f"no KV-cache room: {tokens} tokens wanted, {self.free} of {self.total} free after {timeout:.1f} s"
                ) from None
            self.used += tokens
        return tokens

    async def release(self, tokens: int) -> None:
        async with self._changed:
            self.used -= tokens
            self._changed.notify_all()
