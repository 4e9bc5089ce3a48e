"""The server's box of chained training passes (``peers/rpc/passes.py``): a pushed input meets only the request that
named its pusher, early pushes are bounded and counted as their pusher's bytes until taken or expired, and a request
whose push never comes fails within the wait."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from peers.rpc import passes
from peers.rpc.passes import PassBox
from swarm import wire
from swarm.config import Timing
from swarm.errors import BadInputError, BusyError
from swarm.protocol import PassPush

TIMING = dataclasses.replace(Timing.for_tests(), open_timeout=0.3)


def _push(key: str, client: str = "trainer") -> PassPush:
    return PassPush(client=client, key=key)


def test_a_push_meets_the_request_that_named_its_pusher():
    async def main() -> None:
        box = PassBox(TIMING, None)
        x = torch.ones(2, 3, 4)
        waiting = asyncio.create_task(box.take("trainer", "k1", "stage-1"))
        await asyncio.sleep(0)
        with pytest.raises(BadInputError, match="not the hop the trainer named"):
            box.put("stranger", _push("k1"), torch.zeros(2, 3, 4))
        box.put("stage-1", _push("k1"), x)
        assert torch.equal(await waiting, x)
        # early: the push comes first and waits for its request, which must name the same pusher
        box.put("stage-1", _push("k2"), x)
        assert torch.equal(await box.take("trainer", "k2", "stage-1"), x)
        box.put("stranger", _push("k3"), x)
        with pytest.raises(BadInputError, match="pushed by stranger"):
            await box.take("trainer", "k3", "stage-1")
        # another trainer's key of the same name is another pass
        box.put("stage-1", _push("k4", client="other"), x)
        with pytest.raises(BadInputError, match="pushed nothing"):
            await box.take("trainer", "k4", "stage-1")

    asyncio.run(main())


def test_early_pushes_are_bounded_counted_and_expire():
    async def main() -> None:
        budget = wire.ByteBudget(1 << 20, per_caller=1 << 16)
        box = PassBox(TIMING, budget)
        x = torch.ones(1024)  # 4 KiB
        for i in range(16):
            box.put("pusher", _push(f"k{i}"), x)
        assert budget.by_caller.get("trainer", 0) == 16 * 4096
        with pytest.raises(BusyError):  # beyond the pusher's share of the byte budget
            box.put("pusher", _push("big"), torch.ones(1 << 14))
        with pytest.raises(BadInputError, match="pushed already"):
            box.put("pusher", _push("k0"), x)
        await asyncio.sleep(TIMING.open_timeout + 0.2)  # never asked for: dropped, their bytes given back
        assert budget.by_caller.get("trainer", 0) == 0

    asyncio.run(main())


def test_the_number_of_early_pushes_per_trainer_is_capped(monkeypatch):
    async def main() -> None:
        monkeypatch.setattr(passes, "MAX_EARLY_PER_CLIENT", 3)
        box = PassBox(TIMING, None)
        for i in range(3):
            box.put("pusher", _push(f"k{i}"), torch.ones(4))
        with pytest.raises(BadInputError, match="too many"):
            box.put("pusher", _push("k3"), torch.ones(4))
        box.put("pusher", _push("k3", client="other"), torch.ones(4))  # another trainer's passes are not held up

    asyncio.run(main())


def test_a_request_whose_push_never_comes_fails_within_the_wait():
    async def main() -> None:
        box = PassBox(TIMING, None)
        with pytest.raises(BadInputError, match="pushed nothing"):
            await box.take("trainer", "k", "stage-1")
        with pytest.raises(BadInputError, match="pushed nothing"):  # and its slot is gone: it may be asked again
            await box.take("trainer", "k", "stage-1")

    asyncio.run(main())
