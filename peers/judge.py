"""The broker's reading of accusations: once a broker period, while it holds the lease, it judges a few new ones as
every reader does (``swarm.rpc.judging``: the evidence must check and re-run wrong), and leaves every convicted
server out of the placement (``peers.broker.loop.plan_once``): no span, no standby. The broker judges by running the
span itself from its model folder (``local``, in a thread of its own: the broker's rounds never wait on it), never
through servers that merely announce the weights (fresh identities could announce them and judge falsely); where it
cannot run the span (other weights, a folder without those blocks) it convicts no one. A false accusation convicts
nobody and its accuser's later accusations are ignored.

A convicted server started with ``--blocks`` keeps serving what it pinned (the broker never moved it): clients,
which read the same accusations, route around it."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

import torch

from swarm.accusations import Accusation, Accusations, accusations_key
from swarm.config import Timing
from swarm.dht import RecordStore, dht_time
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.protocol import InferenceRequest, InferenceStep, OpenReply, OpenSession, StepReply
from swarm.records import PeerState, ServerRecord, servers
from swarm.rpc.evidence import Facts
from swarm.rpc.judging import Conviction, Docket, differs, judge
from swarm.rpc.remote import Remote
from swarm.rpc.stream import open_session
from swarm.verdict import Local

log = logging.getLogger(__name__)


class BrokerJudge:
    def __init__(
        self,
        store: RecordStore,
        remote: Remote,
        model_id: str,
        num_blocks: int,
        timing: Timing,
        local: Local | None = None,
        counts: collections.Counter[str] | None = None,
    ) -> None:
        """``local``: the broker's own run of a span (``StagePort.local_judge``; None: it judges nothing);
        ``counts``: what it judged, by outcome (upheld, false, dropped: ``PeerMetrics.accusations``)."""
        self.store, self.remote, self.timing, self.local = store, remote, timing, local
        self.counts = collections.Counter() if counts is None else counts
        self.model_id, self.num_blocks = model_id, num_blocks
        self.docket = Docket(store.peer_id, model_id)
        self._asked = -float("inf")

    def convicted(self) -> frozenset[str]:
        """Every server convicted so far. The broker asks each round it holds the lease, and that keeps the judge
        looking (``run``); the broker never waits on a re-run."""
        self._asked = time.monotonic()
        return frozenset(self.docket.convicted)

    async def run(self) -> None:
        """Once a broker period, while the broker asks, judge what is due (a few re-runs at most, off the loop)."""
        loop = asyncio.get_running_loop()
        period = self.timing.broker_period
        while True:
            await asyncio.sleep(period)
            if time.monotonic() - self._asked > 2 * period:
                continue  # not the broker now: nobody is placed on its word
            try:
                await asyncio.to_thread(self._look, loop)
            except Exception as e:  # noqa: BLE001 - the broker plans with what it already knows
                log.info("judging accusations failed: %s", e, extra={"peer": self.store.peer_id})

    def _look(self, loop: asyncio.AbstractEventLoop) -> None:
        records = self.store.read(accusations_key(self.model_id), Accusations)
        if not records:
            return
        announced: dict[str, ServerRecord] = {}
        deadline = self.timing.open_timeout + self.timing.request_timeout + 1.0

        def rerun(facts: Facts, hop: Hop) -> tuple[bool, str] | None:
            return asyncio.run_coroutine_threadsafe(self._rerun(facts, hop), loop).result(deadline)

        def judge_one(accuser: str, item: Accusation, failed: set[str]) -> Conviction | None:
            if not announced:  # read once a look, and only when something is due
                announced.update(servers(self.store.view(self.model_id, self.num_blocks)))
            shunned = self.docket.convicted | self.docket.false_accusers
            live = [r for r in announced.values() if r.state == PeerState.ONLINE and r.peer_id not in shunned]
            d = self.docket
            accused = announced.get(item.accused)
            return judge(accuser, item, accused, live, rerun, d.rng, local=self.local, trusted=d.trusted, failed=failed)

        latest = dht_time() + self.timing.clock_skew
        dropped = len(self.docket.dropped)
        convictions = self.docket.take_up(records, time.monotonic(), latest, judge_one)
        self.counts["dropped"] += len(self.docket.dropped) - dropped
        for c in convictions:
            self.counts["upheld" if c.upheld else "false"] += 1
            who = c.accused if c.upheld else c.accuser
            what = "convicted: left out of placement" if c.upheld else "a false accusation"
            log.warning("broker: %s (%s)", what, c.reason, extra={"peer": who})

    async def _rerun(self, facts: Facts, hop: Hop) -> tuple[bool, str] | None:
        """``hop``'s output on the evidence's context, in one prefill of a session of the broker's own."""
        batch, length = facts.inputs.shape[0], facts.inputs.shape[1]
        x = facts.inputs.to(getattr(torch, hop.dtype)).contiguous()
        positions = torch.arange(length).expand(batch, -1).contiguous()
        t = self.timing
        try:
            stream = await open_session(self.remote, hop, t.open_timeout)
        except SwarmError as e:
            log.info("a judge could not be reached: %s", e, extra={"peer": hop.peer_id})
            return None
        try:
            opening = OpenSession(
                session_id=uuid.uuid4().hex, start=hop.start, end=hop.end, max_length=length, batch_size=batch
            )
            await stream.send(InferenceRequest(open=opening), {})
            await stream.receive(OpenReply, t.open_timeout, 1 << 16)
            step = InferenceRequest(step=InferenceStep(position=0))
            await stream.send(step, {"hidden": x, "position_ids": positions})
            _, out, _ = await stream.receive(StepReply, t.request_timeout, 2 * x.numel() * x.element_size() + 65536)
        except SwarmError as e:
            log.info("a judge failed: %s", e, extra={"peer": hop.peer_id})
            return None
        finally:
            stream.close()
        hidden = out.get("hidden")
        if hidden is None or hidden.shape != x.shape or not bool(torch.isfinite(hidden).all()):
            return None  # a judge that answers nonsense decides nothing
        return differs(facts, hidden.float()[:, facts.offset :], hop)
