"""When each session's steps come back to a server, and what follows from it for the next batch: how long to hold
waiting steps for companions (``hold``) and how many rows one forward may take (``Rhythm.cohort``). Pure: the
scheduler (``peers.serving.scheduler``) feeds it arrivals and forwards with its clock's times."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from peers.serving.runtime import Row


class Step(Protocol):
    """What ``hold`` reads of a waiting step (``peers.serving.scheduler.Waiting``)."""

    @property
    def row(self) -> Row: ...
    @property
    def since(self) -> float: ...
    @property
    def session(self) -> Hashable: ...


CONTENDED = 0.85  # of a core: below it, the device is shared with other work (see ``hold``)
CONTENDED_FORWARDS = 8  # ... and a batch may wait this many forwards' price for companions
PIPELINE_BUSY = 0.5  # busy less of the time than this, a server runs its sessions in two micro-batches (``cohort``)
PIPELINE_ROWS = 4  # ... if at least this many rows step through it (halves of two rows or more)


@dataclass
class Rhythm:
    """When each session's steps arrive: the last arrival and the gap before it, so the scheduler can tell which
    sessions are busy elsewhere in their chain and about to come back (``hold``), and what a forward costs."""

    # session -> (its last arrival, the gap before it, the rows of that step)
    last: dict[Hashable, tuple[float, float | None, int]] = field(default_factory=dict)
    forwards: list[float] = field(default_factory=list)  # the last few forwards' durations
    batch_of: dict[Hashable, int] = field(default_factory=dict)  # session -> the last forward it ran in
    share: float = 1.0  # of a core the compute thread got during recent forwards (CPU time over wall time)
    count: int = 0  # forwards run
    ends: list[float] = field(default_factory=list)  # when the last few forwards ended (``busy``)

    def arrived(self, session: Hashable, now: float, rows: int = 1) -> None:
        before = self.last.get(session)
        self.last[session] = (now, now - before[0] if before is not None else None, rows)
        if len(self.last) > 4096:  # sessions that stopped stepping (closed ones are forgotten at once)
            self.last = {k: v for k, v in self.last.items() if v[1] is not None and now - v[0] < 2 * v[1]}

    def alive(self, session: Hashable, now: float) -> bool:
        """It still steps: it came back within twice its last gap (a session whose client vanished stops counting)."""
        t, gap, _ = self.last.get(session, (now, None, 0))
        return gap is None or now - t < 2 * gap

    def forgot(self, session: Hashable) -> None:
        self.last.pop(session, None)
        self.batch_of.pop(session, None)

    def ran(
        self, seconds: float, sessions: Sequence[Hashable], cpu: float | None = None, end: float | None = None
    ) -> None:
        """A forward of ``sessions`` took ``seconds`` (``cpu`` of them on the compute thread's core, where the
        device is the CPU), ending at ``end`` (the scheduler's clock)."""
        self.forwards = [*self.forwards[-15:], seconds]
        if end is not None:
            self.ends = [*self.ends[-15:], end]
        if cpu is not None and seconds > 0:
            self.share = 0.8 * self.share + 0.2 * min(1.0, cpu / seconds)
        self.count += 1
        for session in sessions:
            if session is not None:
                self.batch_of[session] = self.count

    @property
    def price(self) -> float:
        """What one more forward costs: the quickest of the last few (the smallest batches' time, its fixed part)."""
        return min(self.forwards, default=0.0)

    def busy(self, now: float) -> float:
        """The share of the recent past this server spent in forwards (1.0 until a few are known)."""
        n = min(len(self.ends), len(self.forwards))
        if n < 4:
            return 1.0
        start = self.ends[-n] - self.forwards[-n]
        return min(1.0, sum(self.forwards[-n:]) / max(now - start, 1e-9))

    def cohort(self, now: float, max_rows: int) -> int:
        """Rows one forward may hold. A server that spends most of a round waiting for the rest of its sessions'
        chains (busy under ``PIPELINE_BUSY``: the other hops and the client compute meanwhile) runs the rows of
        its stepping sessions in two micro-batches, half each: the next hop starts on the first while this one
        computes the second, so the hops of a chain compute at once instead of in turn (pipeline parallelism). Each
        half then comes back on its own and runs at once (``hold`` waits for no more than this), so the two stay
        apart. A busy server (the chain's slowest hop) batches everything it has: there, rows per forward are
        what counts. So do fewer than ``PIPELINE_ROWS`` stepping rows: a forward of one row is mostly its fixed cost
        (the interpreter, operator dispatch), so two of them cost nearly twice one of two rows (24 peers on 2 cores,
        two clients, ran every pair of rows as two forwards, and the churn drill's steps slowed until sessions idled
        out; at 16 streams the halves gain more than that, measured: 58-63 tokens/s against 51-58 batching all
        where cores are shared)."""
        stepping = sum(rows for s, (_, _, rows) in self.last.items() if self.alive(s, now))
        if stepping < PIPELINE_ROWS or self.busy(now) >= PIPELINE_BUSY:
            return max_rows
        return min(max_rows, -(-stepping // 2))


def hold(waiting: Sequence[Step], rhythm: Rhythm, now: float, max_rows: int, max_wait: float) -> float:
    """How long to hold the waiting steps for companions before running them (0: run now).

    Companions are sessions computing elsewhere in their chains that will be back soon: those that ran in the same
    forward as a waiting step last time and have not come back yet (a round of a client's streams, split by the
    client's own work between steps), and those whose rhythm (the gap between their last two steps) makes them due.
    Running now and again when they come costs a whole extra forward, so the steps wait for them, at most one
    forward's price after the oldest arrived (the ski-rental bound: never more than the wait may save). Where this
    server's compute thread gets less than ``CONTENDED`` of a core (its device shared with other work: stages of a
    chain on one machine's cores, say), every forward saved is compute the others get back, and the bound grows to
    ``CONTENDED_FORWARDS`` prices (at most half of ``max_wait``), long enough for rounds that drifted apart to merge.
    A lone session, a full batch or a step that has waited long enough never waits."""
    if not waiting or max_rows <= 1 or sum(w.row.rows for w in waiting) >= max_rows:
        return 0.0
    price = rhythm.price * (CONTENDED_FORWARDS if rhythm.share < CONTENDED else 1)
    limit = min(w.since for w in waiting) + min(price, max_wait / 2)
    if limit <= now:
        return 0.0
    here = {w.session for w in waiting}
    theirs = {rhythm.batch_of.get(w.session) for w in waiting} - {None}
    mates = (s for s, b in rhythm.batch_of.items() if b in theirs and s not in here)
    if any(rhythm.alive(s, now) for s in mates):
        return limit - now  # a step that ran with these last time is still on its way (its arrival wakes the loop)
    due = [
        t + gap
        for session, (t, gap, _) in rhythm.last.items()
        if session not in here and gap is not None and rhythm.alive(session, now) and t + gap <= limit
    ]
    return max(0.0, max(due) - now) if due else 0.0
