"""What a client makes of accusations: its own, published in its subkey of the model's accusations key, and others',
each believed only once its evidence checks (``swarm.rpc.evidence``) and re-runs wrong on a server that is neither
the accused nor the accuser. A convicted server is banned for as long as accusations live; an accuser whose
evidence does not check, or re-runs to what the accused committed to, is a false accuser: its accusations are
ignored from then on, and it is banned from this client's routes too in case it serves. The accused loses nothing
by a false accusation."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from swarm.accusations import ACCUSATION_TTL, MAX_ACCUSATIONS, Accusation, Accusations, Evidence, accusations_key
from swarm.client.connection import SwarmConnection
from swarm.client.shadow import Shadow, plain_opening
from swarm.dht import dht_time
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.rpc.evidence import facts_or_none
from swarm.verdict import compare, tolerance

log = logging.getLogger(__name__)
RERUNS_PER_REFRESH = 2  # evidence re-run per look at the accusations (each costs a prefill on some server)


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
    _read_at: float = -float("inf")

    @property
    def convicted(self) -> set[str]:
        return {c.accused for c in self.judged.values() if c.upheld}

    def accuse(self, accused: str, hop: Hop, evidence: Evidence, reason: str) -> bool:
        """Publish an accusation of ``accused`` (over ``hop``'s blocks) with ``evidence``; False if the DHT refused."""
        view = self.conn.view
        fingerprint = view.current_fingerprint(view.snapshot()) or ""
        item = Accusation(
            accused=accused,
            model_id=self.conn.model_id,
            fingerprint=fingerprint,
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
        """Read the accusations (at most every ``view_refresh``) and judge the new ones, a few at a time."""
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
        budget = RERUNS_PER_REFRESH
        for record in records:
            for item in record.items:
                if budget <= 0:
                    return
                key = (record.accuser, item.made, item.accused)
                if record.accuser == self.conn.peer_id or record.accuser in self.false_accusers or key in self.judged:
                    continue
                if item.model_id != self.conn.model_id or item.accused in self.convicted:
                    continue
                budget -= 1
                conviction = self._judge(record.accuser, item)
                if conviction is not None:
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
        """The accusation judged (None: not now, e.g. no server to re-run it on)."""
        facts, why = facts_or_none(item.evidence, item.accused)
        if facts is None:
            return Conviction(item.accused, accuser, f"evidence that does not check: {why}", False)
        view = self.conn.view
        if item.fingerprint != view.current_fingerprint(view.snapshot()):
            return None  # other weights than this client's servers hold: nothing to re-run it on
        exclude = frozenset({item.accused, accuser})
        records = [r for r in view.servers(exclude=exclude) if r.start <= item.start and item.end <= r.end]
        if not records:
            return None
        hop = Hop.of(min(records, key=lambda r: r.peer_id), item.start, item.end)
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
        dtype = str(facts.output.dtype).removeprefix("torch.")
        cmp = compare(facts.output, ref)
        upheld = not cmp.within(tolerance(dtype, hop.dtype))
        how = f"re-run on {hop.peer_id}: {cmp.describe()}"
        return Conviction(item.accused, accuser, f"{item.reason}; {how}" if upheld else how, upheld)
