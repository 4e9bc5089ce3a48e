"""The server's box of chained training passes (``peers/rpc/passes.py``): a pushed input meets only the request that
named its pusher; pushes that come before their request are kept only on a training stage, only from a pusher whose
signed record serves the blocks next to the stage's, counted as that pusher's (slots, bytes and byte budget) whatever
trainer names it writes, and freed when taken or expired; a request whose push never comes fails within the wait."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from peers.rpc import passes
from peers.rpc.directory import ServerDirectory
from peers.rpc.passes import PassBox, Passes, PushRefused
from peers.serving.counters import PeerMetrics
from swarm import wire
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.protocol import ForwardRequest, PassLink, PassPush, TrainTag
from swarm.records import ServerRecord
from tests.helpers.records import record

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


def test_early_pushes_are_counted_as_their_pushers_and_expire():
    async def main() -> None:
        budget = wire.ByteBudget(1 << 20, per_caller=1 << 16)
        box = PassBox(TIMING, budget)
        assert box.max_bytes == 1 << 18 and box.max_pusher_bytes == 1 << 16  # a quarter of the budget, a quarter each
        x = torch.ones(1024)  # 4 KiB
        for i in range(8):
            assert box.put("pusher", _push(f"k{i}", client=f"name-{i}"), x) == "kept"
        # charged to the pusher's identity, never to the trainer names it wrote
        assert budget.by_caller == {"pusher": 8 * 4096} and box.held_by("pusher") == (8, 8 * 4096)
        with pytest.raises(PushRefused, match="pushed already") as refused:
            box.put("pusher", _push("k0", client="name-0"), x)
        assert refused.value.reason == "bad"
        await asyncio.sleep(TIMING.open_timeout + 0.2)  # never asked for: dropped, their bytes given back
        assert budget.by_caller == {} and box.held_by("pusher") == (0, 0)
        assert box.put("pusher", _push("k0", client="name-0"), x) == "kept"  # and the room is the pusher's again

    asyncio.run(main())


def test_one_pusher_holds_its_share_whatever_trainer_names_it_writes():
    async def main() -> None:
        budget = wire.ByteBudget(1 << 30, per_caller=1 << 30)
        box = PassBox(TIMING, budget)
        x = torch.ones(4)
        outcomes = []
        for i in range(4 * passes.MAX_EARLY_PER_PUSHER):  # a made-up trainer name for every push
            try:
                outcomes.append(box.put("sybil", _push(f"k{i}", client=f"made-up-{i}"), x))
            except PushRefused as e:
                outcomes.append(e.reason)
        assert outcomes.count("kept") == passes.MAX_EARLY_PER_PUSHER == box.held_by("sybil")[0] == box.peak
        assert outcomes.count("share") == 3 * passes.MAX_EARLY_PER_PUSHER
        # another pusher, and the honest trainer's passes through it, still find room
        assert box.put("stage-1", _push("honest", client="trainer"), x) == "kept"
        assert torch.equal(await box.take("trainer", "honest", "stage-1"), x)
        assert budget.by_caller == {"sybil": passes.MAX_EARLY_PER_PUSHER * 16}

    asyncio.run(main())


def test_one_pusher_holds_its_share_of_the_early_bytes():
    async def main() -> None:
        box = PassBox(TIMING, wire.ByteBudget(1 << 24))  # 16 MiB held: 4 MiB of early pushes, 1 MiB a pusher
        big = torch.ones(1 << 17)  # 512 KiB
        assert box.put("sybil", _push("a", client="x"), big) == "kept"
        assert box.put("sybil", _push("b", client="y"), big) == "kept"
        with pytest.raises(PushRefused, match="share") as refused:
            box.put("sybil", _push("c", client="z"), torch.ones(1))
        assert refused.value.reason == "share" and box.held_by("sybil") == (2, 1 << 20)
        for pusher in ("s2", "s3", "s4"):  # Sybils fill the room of all pushers together, and no more
            box.put(pusher, _push(f"{pusher}-a", client="x"), big)
            box.put(pusher, _push(f"{pusher}-b", client="y"), big)
        with pytest.raises(PushRefused, match="too many") as refused:
            box.put("s5", _push("s5-a", client="x"), big)
        assert refused.value.reason == "full"

    asyncio.run(main())


def test_a_pusher_keeps_few_pushes_for_one_trainer(monkeypatch):
    async def main() -> None:
        monkeypatch.setattr(passes, "MAX_EARLY_PER_CLIENT", 3)
        box = PassBox(TIMING, None)
        for i in range(3):
            box.put("stage-1", _push(f"k{i}"), torch.ones(4))
        with pytest.raises(PushRefused, match="share"):
            box.put("stage-1", _push("k3"), torch.ones(4))
        # a trainer that has an honest stage push for passes it never asks for blocks neither that stage's pushes
        # for another trainer nor another stage's for itself
        box.put("stage-1", _push("k3", client="other"), torch.ones(4))
        box.put("stage-2", _push("k4"), torch.ones(4))

    asyncio.run(main())


def test_a_request_whose_push_never_comes_fails_within_the_wait():
    async def main() -> None:
        box = PassBox(TIMING, None)
        with pytest.raises(BadInputError, match="pushed nothing"):
            await box.take("trainer", "k", "stage-1")
        with pytest.raises(BadInputError, match="pushed nothing"):  # and its slot is gone: it may be asked again
            await box.take("trainer", "k", "stage-1")

    asyncio.run(main())


def _passes(learner: object | None, records: list[ServerRecord]) -> tuple[Passes, PeerMetrics]:
    """The pass handling of a server holding blocks 3:6 of 9 (a training stage when ``learner`` is set), whose
    directory reads ``records``."""
    loaded = SimpleNamespace(learner=learner, held=Span(3, 6))
    directory = ServerDirectory(lambda _: records, frozenset({"fp"}), 9, ttl=60.0)
    metrics = PeerMetrics()
    chained = Passes(SimpleNamespace(loaded=loaded), directory, TIMING, lambda *_: None, None, metrics, "me")  # type: ignore[arg-type]
    return chained, metrics


def _meta(key: str, client: str = "trainer") -> dict[str, object]:
    return _push(key, client).model_dump(mode="json")


def test_a_training_stage_keeps_pushes_only_from_servers_next_to_its_span():
    async def main() -> None:
        before, after = record(peer_id="before", start=0, end=3), record(peer_id="after", start=6, end=9, num_blocks=9)
        elsewhere = record(peer_id="elsewhere", start=7, end=9, num_blocks=9)
        chained, metrics = _passes(object(), [before, after, elsewhere])
        x = torch.ones(2, 3, 4)
        await chained.accept("before", _meta("a"), {"hidden": x})  # the stage before: an activation
        await chained.accept("after", _meta("b"), {"grad_output": x})  # the stage after: a gradient
        await chained.accept("before", _meta("c"), {"grad_output": x})  # a gradient from before: no
        await chained.accept("after", _meta("d"), {"hidden": x})  # an activation from after: no
        await chained.accept("elsewhere", _meta("e"), {"hidden": x})  # a record, not next to 3:6
        await chained.accept("stranger", _meta("f"), {"hidden": x})  # no record at all
        await chained.accept("me", _meta("g"), {"hidden": x})  # a pass that names this server twice in a row
        await chained.accept("before", _meta("h"), {"hidden": x, "grad_output": x})
        await chained.accept("before", {"kind": "pass", "client": "trainer"}, {"hidden": x})  # no key
        assert metrics.pass_pushes == {"kept": 3, "no_record": 4, "bad": 2}
        assert chained.box.held_by("before")[0] == chained.box.held_by("after")[0] == 1
        assert metrics.pass_early_peak == 1

    asyncio.run(main())


def test_a_server_without_a_training_stage_refuses_passes_and_their_pushes():
    async def main() -> None:
        chained, metrics = _passes(None, [record(peer_id="before", start=0, end=3)])
        await chained.accept("before", _meta("a"), {"hidden": torch.ones(2, 3, 4)})
        assert metrics.pass_pushes == {"no_stage": 1} and chained.box.held_by("before") == (0, 0)
        request = ForwardRequest(
            start=3,
            end=6,
            keep_for_backward=True,
            forward_id="k",
            train=TrainTag(step=0, samples=2, trainer="trainer"),
            relay=PassLink(key="k", source="before"),
        )
        with pytest.raises(BadInputError, match="runs no training stage"):  # at once, not after a wait for a push
            await asyncio.wait_for(chained.run(request, {}, "trainer"), TIMING.open_timeout / 2)

    asyncio.run(main())


def test_one_identity_with_made_up_trainer_names_holds_its_share_and_is_counted_so():
    async def main() -> None:
        chained, metrics = _passes(object(), [record(peer_id="sybil", start=0, end=3)])
        for i in range(2 * passes.MAX_EARLY_PER_PUSHER):
            await chained.accept("sybil", _meta(f"k{i}", client=f"made-up-{i}"), {"hidden": torch.ones(4)})
        assert metrics.pass_pushes == {"kept": passes.MAX_EARLY_PER_PUSHER, "share": passes.MAX_EARLY_PER_PUSHER}
        assert metrics.pass_early_peak == passes.MAX_EARLY_PER_PUSHER

    asyncio.run(main())
