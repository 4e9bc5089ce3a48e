"""Replica synchronisation through hivemind's decentralized averaging (butterfly all-reduce over the DHT), with the
forked averager process tied to the life of its owner."""

from __future__ import annotations

import logging

import torch
from hivemind.averaging import DecentralizedAverager

from swarm.dht import OwnedDHT, die_with_parent
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)


class OwnedAverager(DecentralizedAverager):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's averager, whose forked child never outlives the process that made it (``die_with_parent``).

    It holds the given tensors in shared memory and writes the group's average into them in place."""

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()

    @classmethod
    def for_run(
        cls, tensors: list[torch.Tensor], dht: OwnedDHT, prefix: str, run: RunConfig, start: bool = True
    ) -> OwnedAverager:
        """``start=False``: start it later with ``run_in_background(await_ready=True)``, from the main thread (hivemind
        sets signal handlers there, and the kernel's parent-death signal follows the creating thread)."""
        return cls(
            tensors,
            dht,
            start=start,
            prefix=prefix.replace(".", "_"),  # hivemind forbids dots in a group prefix
            target_group_size=run.averaging_group,
            min_group_size=2,  # an average of one is no average
            min_matchmaking_time=run.matchmaking_seconds,
            request_timeout=run.averaging_request_timeout,
            allreduce_timeout=run.averaging_timeout,
            client_mode=False,  # a trainer's DHT is a client, but its averager must accept groupmates' connections
        )

    def average_round(self, run: RunConfig, what: str) -> bool:
        """One round with whoever is there; a failed round leaves the tensors as they were (the next one catches
        up)."""
        try:
            result = self.step(timeout=run.averaging_timeout, allow_retries=True)
        except Exception as e:
            log.warning("averaging round failed: %s", e, extra={"span": what})
            return False
        log.info("averaged with %d peers", len(result or ()), extra={"span": what})
        return bool(result)
