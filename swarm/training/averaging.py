"""Replica synchronisation through hivemind's decentralized averaging (butterfly all-reduce over the DHT), with the
forked averager process tied to the life of its owner."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException

from swarm.dht import OwnedDHT, die_with_parent
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)


class OwnedAverager(DecentralizedAverager):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's averager, whose forked child never outlives the process that made it (``die_with_parent``).

    It holds the given tensors in shared memory and writes the group's average into them in place.

    hivemind lets anyone who knows the group prefix join a round (its averager has no authorizer). This one takes
    part in a round only when every groupmate is a peer its owner allowed (``allow``: the replicas holding a signed
    stage record of the run, or the run's trainers); otherwise it leaves the group before any tensor is sent, and
    the round fails without changing anything here."""

    _allowed: frozenset[str] = frozenset()  # in the averager's process; nobody until the owner says

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()

    def allow(self, peer_ids: Iterable[str]) -> None:
        """Who may share this averager's rounds (sent to its process, which takes it before the next round)."""
        self._outer_pipe.send(("_set_allowed", [], dict(peer_ids=frozenset(peer_ids))))

    async def _set_allowed(self, peer_ids: frozenset[str]) -> None:
        self._allowed = peer_ids

    # Any: hivemind's GroupInfo and the keyword arguments it passes on, untyped there
    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
        strangers = [
            p.to_base58() for p in group_info.peer_ids if p != self.peer_id and p.to_base58() not in self._allowed
        ]
        if strangers:
            log.warning("left an averaging group with peers outside the run: %s", ", ".join(strangers))
            raise MatchmakingException(f"peers outside the run in the group: {', '.join(strangers)}")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

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
            allow_state_sharing=False,  # joiners take a stage's state over the swarm's own checked path
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
