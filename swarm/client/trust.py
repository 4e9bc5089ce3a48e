"""What a client makes of accusations: its own, published in its subkey of the model's accusations key, and others',
each believed only once its evidence checks (``swarm.rpc.evidence``: signed by the accused, for the claimed blocks,
the context its cache held) and re-runs wrong on servers drawn at random that are neither the accused nor the
accuser: two, and a third where they disagree (the majority rules; one where only one exists). A convicted server
is banned for as long as accusations live. An accuser whose evidence does not check, or re-runs to what the accused
committed to, is a false accuser: its accusations are ignored from then on, and it is banned from this client's
routes too in case it serves. The accused loses nothing by a false accusation.

A reader judges at most ``RERUNS_PER_REFRESH`` accusations per look, at most one per accuser, in random order; one
it cannot judge yet (no server to re-run it on, the accused not announced) waits and is tried again later."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from swarm.accusations import ACCUSATION_TTL, MAX_ACCUSATIONS, Accusation, Accusations, Evidence, accusations_key
from swarm.client.connection import SwarmConnection
from swarm.client.shadow import Shadow, plain_opening
from swarm.dht import dht_time
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.records import servers
from swarm.rpc.evidence import Facts, facts_or_none
from swarm.verdict import compare, tolerance

log = logging.getLogger(__name__)
RERUNS_PER_REFRESH = 2  # accusations judged per look at them (each costs a prefill on one or two servers)
RETRY_AFTER = 60.0  # seconds before an accusation that could not be judged is tried again


@dataclass(frozen=True)
class Conviction:
    accused: str
    accuser: str
    reason: str
    upheld: bool  # the evidence re-ran wrong (False: a false accusation, against the accuser)


@dataclass
class Trust:
    conn: SwarmConnection
    own: list[Accusation] = field(default_factory=list)
    judged: dict[tuple[str, float, str], Conviction] = field(default_factory=dict)
    false_accusers: set[str] = field(default_factory=set)
    waiting: dict[tuple[str, float, str], float] = field(default_factory=dict)  # not judged yet -> retry at
    rng: random.Random = field(default_factory=random.SystemRandom)
    _read_at: float = -float("inf")

    @property
    def convicted(self) -> set[str]:
        return {c.accused for c in self.judged.values() if c.upheld}

    def accuse(self, accused: str, hop: Hop, evidence: Evidence, reason: str) -> bool:
        """Publish an accusation of ``accused`` (over ``hop``'s blocks) with ``evidence``; False if the DHT refused."""
        item = Accusation(
            accused=accused,
            model_id=self.conn.model_id,
            fingerprint=hop.fingerprint,
            start=hop.start,
            end=hop.end,
            reason=reason[:200],
            made=dht_time(),
            evidence=evidence,
        )
        self.own = [*self.own, item][-MAX_ACCUSATIONS:]
        record = Accusations(accuser=self.conn.peer_id, items=tuple(self.own))
        try:
            return self.conn.store.publish(accusations_key(self.conn.model_id), record, dht_time() + ACCUSATION_TTL)
        except Exception as e:  # noqa: BLE001 - the ban stands whether or not others hear of it
            log.warning("publishing an accusation failed: %s", e, extra={"peer": accused})
            return False

    def refresh(self, force: bool = False) -> None:
        """Read the accusations (at most every ``view_refresh``) and judge a few new ones."""
        if not self.conn.cfg.accuse:
            return
        now = time.monotonic()
        if not force and now - self._read_at < self.conn.timing.view_refresh:
            return
        self._read_at = now
        try:
            records = self.conn.store.read(accusations_key(self.conn.model_id), Accusations)
        except Exception as e:  # noqa: BLE001 - routing goes on with what this client knows
            log.info("reading accusations failed: %s", e)
            return
        latest = dht_time() + self.conn.timing.clock_skew
        todo = []
        for record in records:
            if record.accuser == self.conn.peer_id or record.accuser in self.false_accusers:
                continue
            fresh = [
                a
                for a in record.items
                if (record.accuser, a.made, a.accused) not in self.judged
                and a.model_id == self.conn.model_id
                and a.made <= latest
                and a.accused not in self.convicted
                and self.waiting.get((record.accuser, a.made, a.accused), 0.0) <= now
            ]
            if fresh:
                todo.append((record.accuser, fresh[-1]))  # one per accuser and look
        self.rng.shuffle(todo)
        for accuser, item in todo[:RERUNS_PER_REFRESH]:
            key = (accuser, item.made, item.accused)
            try:
                conviction = self._judge(accuser, item)
            except Exception as e:  # noqa: BLE001 - hostile input breaks nothing: it waits, then it is dropped
                log.info("judging an accusation failed: %s", e, extra={"peer": accuser})
                conviction = None
            if conviction is None:
                self.waiting[key] = now + RETRY_AFTER
                continue
            self.waiting.pop(key, None)
            self.judged[key] = conviction
            self._act(conviction)

    def _act(self, c: Conviction) -> None:
        view = self.conn.view
        if c.upheld:
            view.ban(c.accused, ACCUSATION_TTL)
            log.warning("a server was convicted of wrong answers: %s", c.reason, extra={"peer": c.accused})
        else:
            self.false_accusers.add(c.accuser)
            view.ban(c.accuser, ACCUSATION_TTL)
            log.warning("a false accusation: %s", c.reason, extra={"peer": c.accuser})

    def _judge(self, accuser: str, item: Accusation) -> Conviction | None:
        """The accusation judged (None: not now: no server to re-run it on, or the accused not announced)."""
        facts, why = facts_or_none(item.evidence, item.accused, item.start, item.end)
        if facts is None:
            return Conviction(item.accused, accuser, f"evidence that does not check: {why}", False)
        view = self.conn.view
        record = servers(view.snapshot()).get(item.accused)
        if record is None or record.fingerprint != item.fingerprint:
            return None  # the weights it signed its answer with are not known to be the claimed ones: wait
        exclude = frozenset({item.accused, accuser})
        records = [
            r
            for r in view.servers(exclude=exclude)
            if r.fingerprint == item.fingerprint and r.start <= item.start and item.end <= r.end
        ]
        if not records:
            return None
        # two judges drawn at random; a third where they disagree (one of them computes wrong): the majority rules
        judges = self.rng.sample(records, min(3, len(records)))
        verdicts: list[tuple[bool, str]] = []
        for record in judges:
            if len(verdicts) == 2 and verdicts[0][0] == verdicts[1][0]:
                break
            found = self._rerun(facts, Hop.of(record, item.start, item.end))
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

    def _rerun(self, facts: Facts, hop: Hop) -> tuple[bool, str] | None:
        """Whether ``hop`` computes otherwise than the committed output (and how far), None if it failed."""
        batch, length = facts.inputs.shape[0], facts.inputs.shape[1]
        shadow = Shadow(self.conn, hop, plain_opening(length, batch), self.conn.cfg.prefill_chunk)
        positions = torch.arange(length).expand(batch, -1)
        try:
            ref = self.conn.loop.run(shadow.run(facts.inputs.float(), positions))[:, facts.offset :]
        except SwarmError as e:
            self.conn.retrier.note_failure(e, "re-running an accusation")
            return None
        finally:
            shadow.close()
        cmp = compare(facts.output, ref)
        dtype = str(facts.output.dtype).removeprefix("torch.")
        return not cmp.within(tolerance(dtype, hop.dtype)), f"re-run on {hop.peer_id}: {cmp.describe()}"
