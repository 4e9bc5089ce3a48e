"""A stage replica's DiLoCo rounds (``swarm/training/diloco.py``), each overlapping the inner steps that follow it.

At a round's step the replica writes its pseudo-gradient into the averager's buffers and goes on training; a thread
of the round waits for hivemind's all-reduce and computes the outer step from the average (new tensors, nothing the
compute thread uses). At the first step boundary after the round (or before the next round begins) the compute
thread adopts it: the new start, the same on every replica, plus the inner progress this replica made meanwhile.

A round alone (no groupmate) steps at once on the replica's own pseudo-gradient. A round that fails, or whose
average cannot come from honest replicas (``implausible``), changes nothing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.training.averaging import OwnedAverager, round_slack
from swarm.training.diloco import Outcome, OuterSync
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
MAX_ROUND_CHANGE = 0.5  # most an averaging round may move a weight tensor, relative to its norm
RoundState = Callable[[int, Outcome], None]  # publishes the state a round ended with


@dataclass
class _InFlight:
    step: int
    since: list[torch.Tensor]  # the weights the round's pseudo-gradient was taken from
    thread: threading.Thread
    outcome: Outcome | None = None


class OuterRounds:
    def __init__(
        self,
        outer: OuterSync,
        run: RunConfig,
        span: str,
        ended: RoundState,
    ) -> None:
        """``ended(step, outcome)``: called (from the round's thread) with every outer step taken."""
        self.outer, self.run, self.span, self.ended = outer, run, span, ended
        self._in_flight: _InFlight | None = None

    def begin(self, step: int, averager: OwnedAverager | None, groupmates: frozenset[str]) -> None:
        """The round of ``step``, after adopting the last one (waiting for it if it is still running)."""
        self.land(wait=True)
        if averager is None or not groupmates:
            outcome = self.outer.outcome()
            self.outer.adopt(outcome)
            self.ended(step, outcome)
            return
        averager.allow(groupmates)
        own = self.outer.prepare()
        with torch.no_grad():
            since = [p.detach().clone() for p in self.outer.params]
        flight = _InFlight(step, since, threading.Thread(target=lambda: None))
        flight.thread = threading.Thread(
            target=self._average, args=(flight, averager, own), name=f"outer-round-{step}", daemon=True
        )
        self._in_flight = flight
        flight.thread.start()

    def _average(self, flight: _InFlight, averager: OwnedAverager, own: list[torch.Tensor]) -> None:
        if not averager.average_round(self.run, self.span):
            return
        averaged = [b.clone() for b in self.outer.buffers]
        why = implausible(averaged, own, round_slack(self.run))
        if why is None and not all(bool(torch.isfinite(t).all()) for t in averaged):
            why = "it is not finite"
        if why is not None:
            log.warning("outer step of step %d skipped: the average %s", flight.step, why, extra={"span": self.span})
            return
        flight.outcome = self.outer.outcome(averaged)
        self.ended(flight.step, flight.outcome)

    def land(self, wait: bool = False) -> None:
        """Adopt the round in flight if it has ended (``wait``: wait for it), on the compute thread."""
        flight = self._in_flight
        if flight is None or (not wait and flight.thread.is_alive()):
            return
        flight.thread.join()
        self._in_flight = None
        if flight.outcome is not None:
            self.outer.adopt(flight.outcome, since=flight.since)

    def close(self, timeout: float) -> None:
        flight = self._in_flight
        if flight is not None:
            flight.thread.join(timeout)


def implausible(after: list[torch.Tensor], before: list[torch.Tensor], slack: float) -> str | None:
    """Why an averaging round's result cannot come from honest replicas (None if it can): it moved a weight tensor
    by more than ``MAX_ROUND_CHANGE`` of its norm plus ``slack`` per element."""
    for a, b in zip(after, before, strict=True):
        change = float(torch.linalg.vector_norm((a - b).double()))
        bound = MAX_ROUND_CHANGE * float(torch.linalg.vector_norm(b.double())) + slack * b.numel() ** 0.5
        if change != change or change > bound:
            return f"it moved a weight tensor by {change:.3g}, more than {bound:.3g}"
    return None
