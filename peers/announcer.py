"""Publishes this peer's record under each block of its span and refreshes it before it expires."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind.utils import get_dht_time

from swarm.config import Timing
from swarm.dht import announce
from swarm.records import PeerState, ServerRecord

log = logging.getLogger(__name__)


class Announcer:
    def __init__(self, dht, validator, make_record: Callable[[PeerState], ServerRecord], timing: Timing) -> None:
        self.dht = dht
        self.validator = validator
        self.make_record = make_record
        self.timing = timing
        self.state = PeerState.JOINING

    async def publish(self, state: PeerState | None = None) -> None:
        if state is not None:
            self.state = state
        record = self.make_record(self.state)
        expiration = get_dht_time() + self.timing.record_ttl
        ok = await asyncio.to_thread(announce, self.dht, self.validator, record, expiration)
        if not ok:
            log.warning("announce was not stored everywhere", extra={"span": str(record.span)})

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.timing.announce_period)
            try:
                await self.publish()
            except Exception:
                log.exception("announce failed; will retry")
