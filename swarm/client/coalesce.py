"""Concurrent calls of a per-position function (the final norm and LM head) from several threads, run as one call
over all their positions: the client side of batching.

The API serves each request on a thread of its own, and each request's decode step ends with the head: for a model
like SmolLM2 that is a 576 x 49152 matrix read from memory once per call, the same cost for one position as for
thirty. Calls that arrive while another is computing wait for it and then go together (group commit): a lone
caller pays nothing extra, concurrent callers share one read of the weights. Only calls in inference mode are
joined (no caller's autograd graph may reach another's); the function must treat positions independently."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class _Call:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False


class Coalescer:
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._fn = fn
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._leading = False
        self.joined = 0  # calls that went with at least one other (tests and benchmarks read it)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_inference_mode_enabled():
            return self._fn(x)
        call = _Call(x)
        with self._cond:
            self._pending.append(call)
            while self._leading and not call.done:
                self._cond.wait()
            if not call.done:  # lead: take everyone waiting, this call included
                self._leading = True
                batch, self._pending = self._pending, []
        if not call.done:
            self._lead(batch)
        if call.error is not None:
            raise call.error
        assert call.out is not None
        return call.out

    def _lead(self, batch: list[_Call]) -> None:
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
                for c in batch:
                    c.done = True
                self._leading = False
                self._cond.notify_all()
