"""What a client makes of accusations: its own, published in its subkey of the model's accusations key, and others',
judged as every reader judges them (``swarm.rpc.judging``: the evidence checks, and the committed output re-runs
wrong on this client's own copy of the weights where it holds them, otherwise on servers it vouches for: ones whose
work its own verification saw agree with another server's). A convicted server is banned for as long as accusations
live; a false accuser is banned from this client's routes too, in case it serves, and its accusations are ignored
from then on."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from swarm.accusations import ACCUSATION_TTL, MAX_ACCUSATIONS, Accusation, Accusations, Evidence, accusations_key
from swarm.client.connection import SwarmConnection
from swarm.client.verify.shadow import Shadow, plain_opening
from swarm.dht import dht_time
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.records import servers
from swarm.rpc.evidence import Facts
from swarm.rpc.judging import Conviction, Docket, Key, differs, judge
from swarm.verdict import Local

log = logging.getLogger(__name__)


@dataclass
class Trust:
    conn: SwarmConnection
    docket: Docket
    own: list[Accusation] = field(default_factory=list)
    local: Local | None = None  # this client's own run of a span (``swarm.families.recompute.local_judge``)
    _read_at: float = -float("inf")

    @classmethod
    def of(cls, conn: SwarmConnection, local: Local | None = None) -> Trust:
        return cls(conn, Docket(conn.peer_id, conn.model_id), local=local)

    def vouch(self, *peers: str) -> None:
        """``peers``' work on one window agreed (a hop and its verifier): their re-runs count a little more."""
        self.docket.vouch(*peers)

    @property
    def convicted(self) -> set[str]:
        return self.docket.convicted

    @property
    def judged(self) -> dict[Key, Conviction]:
        return self.docket.judged

    @property
    def false_accusers(self) -> set[str]:
        return self.docket.false_accusers

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
        for conviction in self.docket.take_up(records, now, latest, self._judge):
            self._act(conviction)

    def _act(self, c: Conviction) -> None:
        view = self.conn.view
        if c.upheld:
            view.ban(c.accused, ACCUSATION_TTL, for_cause=True)
            log.warning("a server was convicted of wrong answers: %s", c.reason, extra={"peer": c.accused})
        else:
            view.ban(c.accuser, ACCUSATION_TTL, for_cause=True)
            log.warning("a false accusation: %s", c.reason, extra={"peer": c.accuser})

    def _judge(self, accuser: str, item: Accusation, failed: set[str]) -> Conviction | None:
        view = self.conn.view
        accused = servers(view.snapshot()).get(item.accused)
        candidates = view.servers(exclude=frozenset({item.accused, accuser}))
        d = self.docket
        return judge(
            accuser, item, accused, candidates, self._rerun, d.rng, local=self.local, trusted=d.trusted, failed=failed
        )

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
        return differs(facts, ref, hop)
