"""Replica synchronisation through hivemind's decentralized averaging (butterfly all-reduce over the DHT), with the
forked averager process tied to the life of its owner, parts reduced robustly (``swarm/training/robust.py``) and a
round's result applied only once the whole of it has arrived."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_dht_time

from swarm.owned_dht import OwnedDHT, die_with_parent
from swarm.training.codec import Codec, Format
from swarm.training.robust import ClipRule, RobustAllReduceRunner
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)


class OwnedAverager(DecentralizedAverager):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's averager, whose forked child never outlives the process that made it (``die_with_parent``).

    It holds the given tensors in shared memory and writes the group's average into them in place.

    hivemind lets anyone who knows the group prefix join a round (its averager has no authorizer). This one takes
    part in a round only when every groupmate is a peer its owner allowed (``allow``: the replicas holding a signed
    stage record of the run, or the run's trainers); otherwise it leaves the group before any tensor is sent, and
    the round fails without changing anything here.

    Each part this peer reduces is reduced by ``rule`` (``RobustAllReduceRunner``): a groupmate's values far from the
    group's are clipped. The round's differences are applied to the tensors together at its end, and not at all if
    it fails (hivemind applies each tensor as soon as its parts have arrived): a round that fails half-way leaves
    nothing of it behind, and the owner checks a completed round's result as a whole."""

    _allowed: frozenset[str] = frozenset()  # in the averager's process; nobody until the owner says

    def __init__(
        self, *args: object, rule: ClipRule | None = None, codec: Codec | None = None, **kwargs: object
    ) -> None:
        # before hivemind's __init__, which may fork the averager's process
        self._rule = rule or ClipRule()
        self.codec = codec or Codec("none")  # its byte counter is shared with the averager's process
        self._attempts = mp.Value(ctypes.c_longlong, 0, lock=True)
        super().__init__(*args, **kwargs)

    @property
    def attempts(self) -> int:
        """All-reduce rounds this averager began (a round that failed part-way and was retried counts twice)."""
        return int(self._attempts.value)

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

    # Any: hivemind's GroupInfo; as hivemind's method, with the robust runner and the result applied at the end
    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.pop("compression", None)  # the codec is what goes on the wire
        runner = RobustAllReduceRunner(
            rule=self._rule,
            codec=self.codec,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        with self._attempts.get_lock():
            self._attempts.value += 1
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        updates = [update async for update in runner]
        clipped = runner.clipped_peers()
        if clipped:
            log.warning("averaging: contributions clipped (parts by peer): %s", clipped)
        if len(updates) != len(tensors):
            raise AllreduceException(f"the round gave {len(updates)} of {len(tensors)} tensors")
        if runner.tensor_part_container.failed_size:  # hivemind kept this peer's own values where a reducer failed
            raise AllreduceException("a groupmate failed to reduce its parts")
        reducer = runner.tensor_part_reducer
        if any(after < reducer.num_parts for after in reducer.sender_failed_after):
            # hivemind averaged the parts this peer reduced without a groupmate that stopped sending (a stalled or
            # starved one): its own tensors would take a mean the stalled one never takes (it misses its results and
            # retries), and replicas meant to end a round equal would not. So no part of it is applied here either:
            # the round fails and is retried, as it is on the stalled groupmate (stop 68: a DiLoCo round where two of
            # three applied such a round and the third, retrying alone, never found a group again)
            raise AllreduceException("a groupmate stopped sending its parts")
        for tensor, update in zip(tensors, updates, strict=True):
            tensor.add_(update, alpha=self._averaging_alpha)
        self.last_updated = get_dht_time()
        self._state_updated.set()

    @classmethod
    def for_run(
        cls,
        tensors: list[torch.Tensor],
        dht: OwnedDHT,
        prefix: str,
        run: RunConfig,
        start: bool = True,
        weights: int | None = None,
        codec: Format = "none",
        slack: float | None = None,
    ) -> OwnedAverager:
        """``start=False``: start it later with ``run_in_background(await_ready=True)``, from the main thread (hivemind
        sets signal handlers there, and the kernel's parent-death signal follows the creating thread). ``weights``:
        how many of ``tensors`` (the first) are weights, the rest being Adam's moments (default: all). ``codec``: how
        parts go on the wire; ``slack``: how far, per element, honest replicas' weights lie apart at a round
        (default ``round_slack``)."""
        weights = len(tensors) if weights is None else weights
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
            rule=ClipRule.for_weights(weights, len(tensors), round_slack(run) if slack is None else slack),
            codec=Codec(codec, run.sync.density),
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


def round_slack(run: RunConfig) -> float:
    """How far, per element, replicas' weights may lie apart at a round: AdamW moves a weight by about lr a step, so
    replicas that averaged k steps ago differ by at most ~2 lr k; twice that."""
    return 4 * run.lr * max(run.average_every, 1)
