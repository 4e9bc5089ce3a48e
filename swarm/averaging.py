"""Replica synchronisation through hivemind's decentralized averaging (butterfly all-reduce over the DHT), with the
forked averager process tied to the life of its owner."""

from __future__ import annotations

import logging

from hivemind.averaging import DecentralizedAverager

from swarm.dht import die_with_parent

log = logging.getLogger(__name__)


class OwnedAverager(DecentralizedAverager):
    """hivemind's averager, whose forked child never outlives the process that made it (``die_with_parent``).

    It holds the given tensors in shared memory and writes the group's average into them in place."""

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()

    @classmethod
    def for_run(cls, tensors, dht, prefix: str, run, start: bool = True) -> OwnedAverager:
        """``start=False``: start it later with ``run_in_background(await_ready=True)``, from the main thread (hivemind
        sets signal handlers there, and the kernel's parent-death signal follows the creating thread)."""
        return cls(
            tensors,
            dht,
            start=start,
            prefix=prefix.replace(".", "_"),  # hivemind forbids dots in a group prefix
            target_group_size=8,
            min_group_size=2,
            min_matchmaking_time=run.matchmaking_seconds,
            request_timeout=1.0,
            allreduce_timeout=run.matchmaking_seconds * 5,
            client_mode=False,  # a trainer's DHT is a client, but its averager must accept groupmates' connections
        )


def average_round(averager: DecentralizedAverager, run, what: str) -> bool:
    """One round with whoever is there; a failed round leaves the tensors as they were (the next one catches up)."""
    try:
        result = averager.step(timeout=run.matchmaking_seconds * 5, allow_retries=True)
    except Exception as e:
        log.warning("averaging round failed: %s", e, extra={"span": what})
        return False
    log.info("averaged with %d peers", len(result or ()), extra={"span": what})
    return bool(result)
