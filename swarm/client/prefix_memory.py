"""What this client's sessions sent the first hops of their routes, remembered as the chains of block digests those
servers key their kept prefixes by (``swarm.rpc.claims``): a later session whose first input starts the same way,
on the same server and span, claims that part instead of sending it. Only sessions whose first hop said it keeps
them (``OpenReply.keeps``) are remembered. A hint, never trusted: the server looks the claim up in what it kept
for this caller, and a miss costs the client one step sent whole.

Bounded: at most ``limit`` digests (32 bytes each, plus their keys), the least recently used forgotten first. A
server that refused a claim (it could not keep the session after all: no room, or evicted since) is neither
remembered nor claimed at for a while, twice as long after each refusal in a row (``MISS_BACKOFF``), so a server
that cannot keep what its sessions hold costs one step sent twice now and then, not every session."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from swarm.hop import Hop
from swarm.protocol import PrefixUse

# whose kept prefixes a chain names: the server's peer id, its span, its dtype, the session's scope ("" where shared)
Key = tuple[str, int, int, str, str, bool]
MISS_BACKOFF, MAX_BACKOFF = 60.0, 3600.0  # seconds a key is left alone after a refused claim, doubling, at most


def key_of(hop: Hop, prefix: PrefixUse, shared: bool = False) -> Key:
    """Where chains kept on ``hop``'s server are remembered: under the session's scope, or (``shared``: the server
    keeps them where every sharing session finds them) under every sharing session's."""
    return (hop.peer_id, hop.start, hop.end, hop.dtype, "" if shared else prefix.scope, shared)


def keys_of(hop: Hop, prefix: PrefixUse) -> list[Key]:
    """Where a session's claim may be found: its own scope's chains, and the shared ones if it shares."""
    return [key_of(hop, prefix)] + ([key_of(hop, prefix, True)] if prefix.share else [])


class PrefixMemory:
    def __init__(self, limit: int = 1 << 14, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.clock = limit, clock
        self._blocked: dict[Key, tuple[float, int]] = {}  # key -> (left alone until, refusals in a row)
        self._known: OrderedDict[tuple[Key, bytes], None] = OrderedDict()
        self._keys: dict[Key, int] = {}  # digests held per key (a key with none is never hashed for)
        self._lock = threading.Lock()  # sessions of one client step on several threads (the API's workers)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._keys)

    def has(self, key: Key) -> bool:
        with self._lock:
            return self._keys.get(key, 0) > 0 and not self._left_alone(key)

    def remember(self, key: Key, chain: list[bytes]) -> None:
        with self._lock:
            if self._left_alone(key):
                return
            for d in chain:
                if (key, d) not in self._known:
                    self._keys[key] = self._keys.get(key, 0) + 1
                self._known[(key, d)] = None
                self._known.move_to_end((key, d))
            while len(self._known) > self.limit:
                (old, _), _ = self._known.popitem(last=False)
                self._drop_one(old)

    def longest(self, key: Key, chain: list[bytes]) -> int:
        """How many of ``chain``'s blocks a remembered chain of ``key`` holds (0: none)."""
        with self._lock:
            for k in range(len(chain), 0, -1):
                if (key, chain[k - 1]) in self._known:
                    self._known.move_to_end((key, chain[k - 1]))
                    return k
        return 0

    def refused(self, key: Key) -> None:
        """A claim at ``key`` was refused: its chains are forgotten, and it is left alone for a while."""
        with self._lock:
            for known in [k for k in self._known if k[0] == key]:
                del self._known[known]
            self._keys.pop(key, None)
            misses = self._blocked.get(key, (0.0, 0))[1] + 1
            self._blocked[key] = (self.clock() + min(MAX_BACKOFF, MISS_BACKOFF * 2 ** (misses - 1)), misses)

    def honoured(self, key: Key) -> None:
        """A claim at ``key`` was answered: refusals before it no longer count."""
        with self._lock:
            self._blocked.pop(key, None)

    def _left_alone(self, key: Key) -> bool:
        blocked = self._blocked.get(key)
        return blocked is not None and blocked[0] > self.clock()

    def _drop_one(self, key: Key) -> None:
        left = self._keys.get(key, 0) - 1
        if left > 0:
            self._keys[key] = left
        else:
            self._keys.pop(key, None)
