"""How many copies of a trainable stage's state (its weights and both Adam moments: three times the weights) exist
at once for callers, and how often one caller gets one.

A state request makes a full copy, held until its reply is sent: without limits, anyone asking as often as it likes
would hold the server's memory (and its compute thread and uplink) at will. Honest callers ask rarely: a joining
replica (once per replica per join, twice when a round ended during its download), an export, a test reading a
stage. So:

- copies held at once: ``PER_CALLER`` per caller, ``TOTAL`` for all callers together (``Quota``), each counted in
  the server's ``ByteBudget`` (its bytes of requests held) from before it is made until its reply is sent or
  dropped;
- per caller, a token bucket: ``BURST`` copies at once, then one per ``Timing.state_interval``. The buckets of at
  most ``MAX_CALLERS`` callers are remembered (a full bucket is forgotten), so many identities cost nothing either.

Over any limit the request is refused with ``BusyError`` naming it, before anything is copied."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

from peers.serving.limits import Quota
from peers.serving.ports import Tensors
from swarm import wire
from swarm.errors import BusyError
from swarm.protocol import Message, StateReply

PER_CALLER = 1
TOTAL = 2
BURST = 4
MAX_CALLERS = 4096


class Frames(list[wire.Frame]):
    """A reply's frames that give their state copy back once the last reference to them is gone (sent or dropped):
    a plain list cannot carry the finalizer."""


class StateCopy:
    """One admitted copy: the reply and its tensors, until ``frames`` encodes them; then its frames. Released once."""

    def __init__(self, release: Callable[[], None], reply: StateReply, tensors: Tensors) -> None:
        self._release: Callable[[], None] | None = release
        self.reply, self.tensors = reply, tensors

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def frames(self, encode: Callable[[Message, Tensors], list[wire.Frame]]) -> list[wire.Frame]:
        """The encoded reply, holding the copy's place until it is sent: the tensors are dropped here (the frames
        hold the bytes), the copy's slot and bytes are given back when the frames are."""
        try:
            out = Frames(encode(self.reply, self.tensors))
        except BaseException:
            self.release()
            raise
        finally:
            self.tensors = {}
        weakref.finalize(out, self.release)
        return out


class StateGate:
    def __init__(
        self,
        interval: float,
        per_caller: int = PER_CALLER,
        total: int = TOTAL,
        burst: int = BURST,
        max_callers: int = MAX_CALLERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        flags = ("one copy per caller", f"{total} copies for all callers")
        self.copies = Quota("state copies held", per_caller, total, flags)
        self.interval, self.burst, self.max_callers, self.clock = interval, burst, max_callers, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, when counted)

    def _tokens(self, caller: str, now: float) -> float:
        tokens, then = self.buckets.get(caller, (float(self.burst), now))
        if self.interval <= 0:
            return float(self.burst)
        return min(float(self.burst), tokens + (now - then) / self.interval)

    def _forget_full(self, now: float) -> None:
        for caller in [c for c in self.buckets if self._tokens(c, now) >= self.burst]:
            del self.buckets[caller]

    def admit(self, caller: str, nbytes: int, budget: wire.ByteBudget | None) -> Callable[[], None]:
        """Count one copy of ``nbytes`` for ``caller``, or refuse it (``BusyError``); returns its release."""
        now = self.clock()
        tokens = self._tokens(caller, now)
        if tokens < 1.0:
            wait = (1.0 - tokens) * self.interval
            raise BusyError(
                f"state requests: this caller had its {self.burst} copies and gets one every {self.interval:g} s "
                f"(Timing.state_interval); ask again in {wait:.1f} s"
            )
        if caller not in self.buckets and len(self.buckets) >= self.max_callers:
            self._forget_full(now)
            if len(self.buckets) >= self.max_callers:
                raise BusyError(f"state requests: {self.max_callers} callers asked recently; try again later")
        self.copies.acquire(caller)
        try:
            if budget is not None:
                budget.take(nbytes)
        except BaseException:
            self.copies.release(caller)
            raise
        self.buckets[caller] = (tokens - 1.0, now)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.copies.release(caller)
                if budget is not None:
                    budget.give(nbytes)

        return release
