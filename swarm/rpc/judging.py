"""Judging accusations (``swarm.accusations``): the part every reader shares, clients (``swarm.client.verify.trust``)
and the broker (``peers.judge``). Each believes an accusation only once its evidence checks (``swarm.rpc.evidence``:
signed by the accused, for the claimed blocks, the context its cache held) and the committed output is found wrong
by someone the reader has reason to believe:

- **itself**, where it holds the weights the accused announced (unquantized, any serving dtype): it runs the span
  from its own model folder, one block at a time (``swarm.families.recompute``), and that decides alone;
- otherwise **servers it vouches for**: ones whose work it has itself seen agree with another server's, window after
  window (``VOUCH_WINDOWS``), never merely ones that announce the weights: fingerprints and records are
  self-claimed, and fresh identities announcing the span and judging falsely would otherwise convict an honest
  server on evidence built from its own right answers. Two are drawn at random (never the accused nor the
  accuser), a third where they disagree (the majority rules; one where only one exists).

An accuser whose evidence does not check, or re-runs to what the accused committed to, is a false accuser: its
accusations are ignored from then on. The accused loses nothing by a false accusation.

A reader takes up at most ``RERUNS_PER_LOOK`` accusations per look, at most one per accuser, in random order; one
it cannot judge yet (no judge it vouches for, the accused not announced, a judge that failed) waits ``RETRY_AFTER``
seconds, a judge that failed is not drawn again for it, and after ``MAX_ATTEMPTS`` it is dropped, undecided: it
convicts no one and costs its accuser nothing."""

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
from swarm.verdict import Local, compare, tolerance

log = logging.getLogger(__name__)
RERUNS_PER_LOOK = 2  # accusations judged per look at them (each costs a prefill on one or two servers)
RETRY_AFTER = 60.0  # seconds before an accusation that could not be judged is tried again
MAX_ATTEMPTS = 3  # ...and the attempts after which it is dropped, undecided
VOUCH_WINDOWS = 3  # windows of a server's work a reader saw agree with another server's before it believes its re-runs

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
    attempts: dict[Key, int] = field(default_factory=dict)  # ...and the attempts made at it
    failed_judges: dict[Key, set[str]] = field(default_factory=dict)  # judges that failed it: not drawn again for it
    dropped: set[Key] = field(default_factory=set)  # undecided after MAX_ATTEMPTS: convicts no one
    vouches: dict[str, int] = field(default_factory=dict)  # server -> windows of its work this reader saw agree
    rng: random.Random = field(default_factory=random.SystemRandom)

    @property
    def convicted(self) -> set[str]:
        return {c.accused for c in self.judged.values() if c.upheld}

    @property
    def trusted(self) -> frozenset[str]:
        """The servers whose re-runs this reader believes (never a convicted one)."""
        convicted = self.convicted
        return frozenset(p for p, n in self.vouches.items() if n >= VOUCH_WINDOWS and p not in convicted)

    def vouch(self, *peers: str) -> None:
        """This reader saw ``peers``' work on one window agree (a hop and its verifier): one vouch each."""
        for peer in peers:
            if peer in self.vouches or len(self.vouches) < 4096:  # bounded: servers are many, but not unbounded
                self.vouches[peer] = self.vouches.get(peer, 0) + 1

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
                and (record.accuser, a.made, a.accused) not in self.dropped
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
        judge_one: Callable[[str, Accusation, set[str]], Conviction | None],
    ) -> list[Conviction]:
        """Judge what is due with ``judge_one`` (given the judges that failed it so far, which it adds to); the new
        convictions (upheld or against their accuser)."""
        out = []
        for accuser, item in self.due(records, now, latest):
            key = (accuser, item.made, item.accused)
            failed = self.failed_judges.setdefault(key, set())
            try:
                conviction = judge_one(accuser, item, failed)
            except Exception as e:  # noqa: BLE001 - hostile input breaks nothing: it waits, then it is dropped
                log.info("judging an accusation failed: %s", e, extra={"peer": accuser})
                conviction = None
            if conviction is None:
                self.attempts[key] = self.attempts.get(key, 0) + 1
                if self.attempts[key] >= MAX_ATTEMPTS:
                    self.drop(key)
                else:
                    self.waiting[key] = now + RETRY_AFTER
                continue
            self.failed_judges.pop(key, None)
            self.attempts.pop(key, None)
            self.waiting.pop(key, None)
            self.judged[key] = conviction
            if not conviction.upheld:
                self.false_accusers.add(accuser)
            out.append(conviction)
        return out

    def drop(self, key: Key) -> None:
        self.dropped.add(key)
        self.waiting.pop(key, None)
        self.attempts.pop(key, None)
        self.failed_judges.pop(key, None)
        log.info("an accusation dropped undecided after %d attempts", MAX_ATTEMPTS, extra={"peer": key[2]})


def judge(
    accuser: str,
    item: Accusation,
    accused: ServerRecord | None,
    candidates: list[ServerRecord],
    rerun: Rerun,
    rng: random.Random,
    *,
    local: Local | None = None,
    trusted: frozenset[str] = frozenset(),
    failed: set[str] | None = None,
) -> Conviction | None:
    """``item`` judged (None: not now): ``accused`` is the accused's live record (None: not announced),
    ``candidates`` the live servers a reader may ask (neither accused nor accuser are taken from them), of which only
    the ``trusted`` are asked, none in ``failed`` (a judge that fails is added there); ``local``: the reader's own
    run of the span, which decides alone where it has the weights."""
    facts, why = facts_or_none(item.evidence, item.accused, item.start, item.end)
    if facts is None:
        return Conviction(item.accused, accuser, f"evidence that does not check: {why}", False)
    if local is not None:
        mine = local(facts.inputs, item.start, item.end, item.fingerprint)
        if mine is not None:
            upheld, said = differs(facts, mine[:, facts.offset :], Hop("this reader (its own weights)", 0, 1))
            return Conviction(item.accused, accuser, f"{item.reason}; {said}" if upheld else said, upheld)
    if accused is None or accused.fingerprint != item.fingerprint:
        return None  # the weights it signed its answer with are not known to be the claimed ones: wait
    failed = set() if failed is None else failed
    records = [
        r
        for r in candidates
        if r.peer_id not in (item.accused, accuser)
        and r.peer_id in trusted
        and r.peer_id not in failed
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
            failed.add(record.peer_id)
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
