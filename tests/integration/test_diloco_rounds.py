"""DiLoCo rounds between real averagers (``OwnedAverager``: hivemind's, with the robust reduction and the codec) on
loopback: three replicas with different inner progress average their pseudo-gradients, sent whole, at 8 bits or as
their top 5% with error feedback; every replica ends with the same outer step, equal to one process's Nesterov SGD
on the mean of what they sent, and the bytes they sent are what the format promises."""

from __future__ import annotations

import pytest
import torch

from swarm.training.averaging import OwnedAverager
from swarm.training.codec import Codec
from swarm.training.diloco import OuterSync
from swarm.training.robust import ClipRule
from swarm.training.run import Sync
from tests.helpers.runs import AVERAGER_TIMINGS, dhts

SIZES = (30_000, 4_000)  # two tensors: several parts, reduced by each of the three peers
SLACK = 1e-2


def _parties(sync: Sync) -> list[tuple[list[torch.nn.Parameter], OuterSync]]:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=g) * 0.02 for n in SIZES]
    parties = []
    for _ in range(3):
        params = [torch.nn.Parameter(s.clone()) for s in start]
        outer = OuterSync(params, sync)
        with torch.no_grad():  # each replica's inner steps took it somewhere else
            for p in params:
                p.sub_(torch.randn(p.shape, generator=g) * 1e-3)
        parties.append((params, outer))
    return parties


@pytest.mark.parametrize("compression", ["none", "int8", "topk"])
def test_replicas_take_the_same_outer_step_equal_to_one_process(compression):
    sync = Sync(method="diloco", compression=compression, density=0.05, outer_lr=0.7, outer_momentum=0.9)
    parties = _parties(sync)
    sent = [outer.prepare() for _, outer in parties]
    start = [t.clone() for t in parties[0][1].anchor]
    with dhts(3) as started:
        ids = [d.peer_id.to_base58() for d in started]
        averagers = [
            OwnedAverager(
                outer.buffers,
                dht,
                start=True,
                prefix=f"diloco_test_{compression}",
                target_group_size=3,
                min_group_size=3,
                **AVERAGER_TIMINGS,
                client_mode=False,
                allow_state_sharing=False,
                rule=ClipRule.for_weights(2, 2, slack=SLACK),
                codec=Codec(compression, sync.density),
            )
            for (_, outer), dht in zip(parties, started, strict=True)
        ]
        try:
            for averager, me in zip(averagers, ids, strict=True):
                averager.allow(i for i in ids if i != me)
            controls = [a.step(wait=False, timeout=40.0, allow_retries=True) for a in averagers]
            assert all(c.result(timeout=45.0) is not None for c in controls)
            for averager, (_, outer) in zip(averagers, parties, strict=True):
                with averager.get_tensors() as averaged:
                    outer.step([t.clone() for t in averaged])
            sent_bytes = [a.codec.sent for a in averagers]
            rounds = max(a.attempts for a in averagers)  # a round that failed part-way sent at most a whole one's
        finally:
            for averager in averagers:
                averager.shutdown()

    # one process: Nesterov SGD on the mean of what the three sent
    for k in range(len(SIZES)):
        mean = sum(s[k] for s in sent) / 3
        reference = torch.nn.Parameter(start[k].clone())
        opt = torch.optim.SGD([reference], lr=sync.outer_lr, momentum=sync.outer_momentum, nesterov=True)
        reference.grad = mean
        opt.step()
        weights = [params[k].detach() for params, _ in parties]
        for other in weights[1:]:  # every replica took the same step
            assert torch.allclose(weights[0], other, rtol=0, atol=1e-6)
        # within the 8-bit rounding of what went on the wire (none: exact up to float32 sums)
        step = 0.0 if compression == "none" else 2 * float(max(s[k].abs().max() for s in sent)) / 127
        tolerance = 1e-6 + sync.outer_lr * (1 + sync.outer_momentum) * step
        assert float((weights[0] - reference.detach()).abs().max()) <= tolerance, compression
    values = sum(SIZES)
    # each part goes from its two other holders to its reducer, and back to both: 4 copies of the vector in all, as
    # the format encodes it (top-k: the reduced parts hold the union of the three's values, up to 3x as many)
    per_value = {"none": 4.0, "int8": 1 + 4 / 256, "topk": 0.05 * 5 * (1 + 3) / 2}[compression]
    assert sum(sent_bytes) <= rounds * (1.01 * 4 * values * per_value + 2000), (sent_bytes, rounds)
    if compression == "topk":  # far below even the 8-bit format
        assert sum(sent_bytes) < rounds * 0.5 * 4 * values
