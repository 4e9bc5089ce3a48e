"""Concurrent calls of a per-position function (the final norm and LM head) from several threads, run as one call
over all their positions: the client side of batching.

The API serves each request on a thread of its own, and each request's decode step ends with the head: for a model
like SmolLM2 that is a 576 x 49152 matrix read from memory once per call, the same cost for one position as for
thirty. Calls that arrive while another is computing wait for it and then go together (group commit): a lone
caller pays nothing extra, concurrent callers share one read of the weights. Only calls in inference mode are
joined (no caller's autograd graph may reach another's); the function must treat positions independently.

Held for companions: decode steps come back from the last server of their chain as a burst (its batch's rows, one
session after another), so the first caller of a burst would run alone and the rest together: two reads of the
weights where one does. The leader therefore waits while callers keep arriving, until none came for ``GAP`` seconds,
at most one call's price (the quickest recent call: never more than the wait may save), and only while another
thread has called recently and is not here yet (a lone stream never waits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

GAP = 0.002  # seconds without a new call that end a burst
RECENT = 1.0  # a thread that called within this long is a stream still decoding: its next call may be near


class _Call:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False


class Coalescer:
    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        clock: Callable[[], float] = time.monotonic,
        gap: float = GAP,
        recent: float = RECENT,
    ) -> None:
        self._fn = fn
        self._clock, self._gap, self._recent = clock, gap, recent
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._leading = False
        self._last: dict[int, float] = {}  # thread -> when it last called
        self._arrived = 0.0  # when the latest pending call came
        self._prices: list[float] = []  # the last few calls' durations
        self.joined = 0  # calls that went with at least one other (tests and benchmarks read it)
        self.calls = 0  # calls of ``fn`` (tests and benchmarks read it)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_inference_mode_enabled():
            return self._fn(x)
        call = _Call(x)
        with self._cond:
            now = self._clock()
            self._pending.append(call)
            self._arrived = now
            self._last[threading.get_ident()] = now
            self._cond.notify_all()  # a holding leader sees the burst go on
            while self._leading and not call.done:
                self._cond.wait()
            if not call.done:  # lead: hold for the rest of the burst, then take everyone waiting
                self._leading = True
                self._hold()
                batch, self._pending = self._pending, []
        if not call.done:
            self._lead(batch)
        if call.error is not None:
            raise call.error
        assert call.out is not None
        return call.out

    def _hold(self) -> None:
        """(Under the lock.) Wait while companions may come: see the module's doc."""
        start = self._clock()
        self._last = {t: at for t, at in self._last.items() if start - at < self._recent}
        price = min(self._prices, default=0.0)
        while len(self._last) > len(self._pending):  # another stream called lately and is not here
            now = self._clock()
            left = min(self._arrived + self._gap, start + price) - now
            if left <= 0:
                return
            self._cond.wait(left)

    def _lead(self, batch: list[_Call]) -> None:
        started = self._clock()
        self.calls += 1
        try:
            if len(batch) == 1:
                batch[0].out = self._fn(batch[0].x)
            else:
                width = batch[0].x.shape[-1]
                flat = torch.cat([c.x.reshape(-1, width) for c in batch])
                with torch.inference_mode():
                    out = self._fn(flat)
                at = 0
                for c in batch:
                    rows = c.x.numel() // width
                    c.out = out[at : at + rows].reshape(*c.x.shape[:-1], out.shape[-1])
                    at += rows
                self.joined += len(batch)
        except Exception as e:
            if len(batch) == 1:
                batch[0].error = e
            else:  # each alone, so only a call at fault hears its error
                for c in batch:
                    try:
                        c.out = self._fn(c.x)
                    except Exception as e:
                        c.error = e
        finally:
            with self._cond:
                self._prices = [*self._prices[-7:], self._clock() - started]
                for c in batch:
                    c.done = True
                self._leading = False
                self._cond.notify_all()
