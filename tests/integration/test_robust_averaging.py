"""Real averagers (``OwnedAverager``: hivemind's, with the robust reduction) in one averaging round on loopback, one
of them holding values far from the others' (a replica that computed garbage within the bounds of what it may send):
the round's result stays by the honest replicas' mean, where hivemind's plain mean would be dragged away."""

from __future__ import annotations

import torch

from swarm.training.averaging import OwnedAverager
from swarm.training.robust import ClipRule
from tests.helpers.runs import AVERAGER_TIMINGS, dhts

SIZE = 20_000  # two tensors of this many values: several parts, reduced by each of the three peers
SLACK = 1e-3  # how far, per element, the rule lets replicas' weights lie apart


def test_a_replica_far_from_the_others_cannot_drag_the_round():
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(SIZE, generator=g) * 0.02 for _ in range(2)]
    honest = [[b + 1e-4 * torch.randn(SIZE, generator=g) for b in base] for _ in range(2)]
    garbage = [b + 5.0 for b in base]  # far off, finite, and the same shape: all a bound on shapes would check
    held = [*honest, garbage]
    honest_mean = [(honest[0][k] + honest[1][k]) / 2 for k in range(2)]
    with dhts(3) as started:
        ids = [d.peer_id.to_base58() for d in started]
        averagers = [
            OwnedAverager(
                [t.clone() for t in tensors],
                dht,
                start=True,
                prefix="robust_test",
                target_group_size=3,
                min_group_size=3,  # the three of them, never a pair
                **AVERAGER_TIMINGS,
                client_mode=False,
                allow_state_sharing=False,
                rule=ClipRule.for_weights(2, 2, slack=SLACK),
            )
            for tensors, dht in zip(held, started, strict=True)
        ]
        try:
            for averager, me in zip(averagers, ids, strict=True):
                averager.allow(i for i in ids if i != me)
            controls = [a.step(wait=False, timeout=40.0, allow_retries=True) for a in averagers]
            groups = [c.result(timeout=45.0) for c in controls]
            assert all(group is not None and len(group) == 3 for group in groups)
            results = []
            for averager in averagers:
                with averager.get_tensors() as tensors:
                    results.append([t.clone() for t in tensors])
        finally:
            for averager in averagers:
                averager.shutdown()
    for k in range(2):
        # every replica ends with the same values (each part reduced once, by one peer, for all)
        assert torch.allclose(results[0][k], results[1][k], rtol=0, atol=1e-6)
        assert torch.allclose(results[0][k], results[2][k], rtol=0, atol=1e-6)
        moved = float((results[0][k] - honest_mean[k]).norm())
        apart = float((honest[0][k] - honest[1][k]).norm())
        # the far replica's pull is clipped to a few times the honest replicas' own distance
        assert moved <= 3 * apart, (moved, apart)
        plain = float(((honest[0][k] + honest[1][k] + garbage[k]) / 3 - honest_mean[k]).norm())
        assert plain > 100 * moved  # hivemind's mean would have moved every weight by 5 / 3
