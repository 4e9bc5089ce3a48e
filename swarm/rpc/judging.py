"""Judging accusations (``swarm.accusations``): the part every reader shares, clients (``swarm.client.verify.trust``)
and the broker (``peers.judge``). Each believes an accusation only once its evidence checks (``swarm.rpc.evidence``:
signed by the accused, for the claimed blocks, the context its cache held) and re-runs wrong on servers drawn at random
that are neither the accused nor the accuser: two, and a third where they disagree (the majority rules; one where only
one exists). An accuser whose evidence does not check, or re-runs to what the accused committed to, is a false accuser:
its accusations are ignored from then on. The accused loses nothing by a false accusation.

A reader takes up at most ``RERUNS_PER_LOOK`` accusations per look, at most one per accuser, in random order; one
it cannot judge yet (no server to re-run it on, the accused not announced) waits ``RETRY_AFTER`` seconds."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.accusations import Accusation, Accusations
from swarm.hop import Hop
from swarm.records import ServerRecord
from swarm.rpc.evidence import Facts, facts_or_none
from swarm.verdict import compare, tolerance

log = logging.getLogger(__name__)
RERUNS_PER_LOOK = 2  # accusations judged per look at them (each costs a prefill on one or two servers)
RETRY_AFTER = 60.0  # seconds before an accusation that could not be judged is tried again

Key = tuple[str, float, str]  # (accuser, made, accused)
# a judge's re-run of the facts on a hop: (wrong, how far), None if that server failed
Rerun = Callable[[Facts, Hop], "tuple[bool, str] | None"]


@dataclass(frozen=True)
class Conviction:
    accused: str
    accuser: str
    reason: str
    upheld: bool  # the evidence re-ran wrong (False: a false accusation, against the accuser)


@dataclass
class Docket:
    """What one reader has judged, who it found lying, and what waits."""

    me: str
    model_id: str
    judged: dict[Key, Conviction] = field(default_factory=dict)
    false_accusers: set[str] = field(default_factory=set)
    waiting: dict[Key, float] = field(default_factory=dict)  # not judged yet -> retry at (monotonic seconds)
    rng: random.Random = field(default_factory=random.SystemRandom)

    @property
    def convicted(self) -> set[str]:
        return {c.accused for c in self.judged.values() if c.upheld}

    def due(self, records: list[Accusations], now: float, latest: float) -> list[tuple[str, Accusation]]:
        """The accusations to judge on this look: new, of this model, not dated after ``latest`` (DHT time), one
        per accuser (its newest), at most ``RERUNS_PER_LOOK`` in random order."""
        convicted = self.convicted
        todo = []
        for record in records:
            if record.accuser == self.me or record.accuser in self.false_accusers:
                continue
            fresh = [
                a
                for a in record.items
                if (record.accuser, a.made, a.accused) not in self.judged
                and a.model_id == self.model_id
                and a.made <= latest
                and a.accused not in convicted
                and self.waiting.get((record.accuser, a.made, a.accused), 0.0) <= now
            ]
            if fresh:
                todo.append((record.accuser, fresh[-1]))
        self.rng.shuffle(todo)
        return todo[:RERUNS_PER_LOOK]

    def take_up(
        self,
        records: list[Accusations],
        now: float,
        latest: float,
        judge_one: Callable[[str, Accusation], Conviction | None],
    ) -> list[Conviction]:
        """Judge what is due with ``judge_one``; the new convictions (upheld or against their accuser)."""
        out = []
        for accuser, item in self.due(records, now, latest):
            key = (accuser, item.made, item.accused)
            try:
                conviction = judge_one(accuser, item)
            except Exception as e:  # noqa: BLE001 - hostile input breaks nothing: it waits, then it is dropped
                log.info("judging an accusation failed: %s", e, extra={"peer": accuser})
                conviction = None
            if conviction is None:
                self.waiting[key] = now + RETRY_AFTER
                continue
            self.waiting.pop(key, None)
            self.judged[key] = conviction
            if not conviction.upheld:
                self.false_accusers.add(accuser)
            out.append(conviction)
        return out


def judge(
    accuser: str,
    item: Accusation,
    accused: ServerRecord | None,
    candidates: list[ServerRecord],
    rerun: Rerun,
    rng: random.Random,
) -> Conviction | None:
    """``item`` judged (None: not now): ``accused`` is the accused's live record (None: not announced),
    ``candidates`` the live servers a reader may ask (neither accused nor accuser are taken from them)."""
    facts, why = facts_or_none(item.evidence, item.accused, item.start, item.end)
    if facts is None:
        return Conviction(item.accused, accuser, f"evidence that does not check: {why}", False)
    if accused is None or accused.fingerprint != item.fingerprint:
        return None  # the weights it signed its answer with are not known to be the claimed ones: wait
    records = [
        r
        for r in candidates
        if r.peer_id not in (item.accused, accuser)
        and r.fingerprint == item.fingerprint
        and r.start <= item.start
        and item.end <= r.end
    ]
    if not records:
        return None
    # two judges drawn at random; a third where they disagree (one of them computes wrong): the majority rules
    judges = rng.sample(records, min(3, len(records)))
    verdicts: list[tuple[bool, str]] = []
    for record in judges:
        if len(verdicts) == 2 and verdicts[0][0] == verdicts[1][0]:
            break
        found = rerun(facts, Hop.of(record, item.start, item.end))
        if found is None:
            return None
        verdicts.append(found)
    wrong = sum(v[0] for v in verdicts)
    how = "; ".join(v[1] for v in verdicts)
    if 2 * wrong > len(verdicts):
        return Conviction(item.accused, accuser, f"{item.reason}; {how}", True)
    if 2 * wrong < len(verdicts):
        return Conviction(item.accused, accuser, how, False)
    return None  # one judge each way and no third: try again later


def differs(facts: Facts, rerun_output: torch.Tensor, hop: Hop) -> tuple[bool, str]:
    """Whether a judge's output (positions ``facts.offset:`` on) is outside the honest tolerance of the committed
    one, and how far."""
    cmp = compare(facts.output, rerun_output)
    dtype = str(facts.output.dtype).removeprefix("torch.")
    return not cmp.within(tolerance(dtype, hop.dtype)), f"re-run on {hop.peer_id}: {cmp.describe()}"
