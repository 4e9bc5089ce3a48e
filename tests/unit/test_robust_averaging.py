"""The robust reduction of averaging rounds (``swarm/training/robust.py``) with real tensors: honest parts that agree
give the plain mean; one part far from the others, whatever it holds, moves the result only as far as the rule
allows; hivemind's part reducer, driven as its all-reduce drives it, reduces that way."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.training.robust import ClipRule, PartBound, RobustPartReducer, centered_clip

LOOSE = PartBound(relative=1.0)  # the a-priori bound out of the way: the group's own spread decides


def honest(n: int, size: int = 4096, spread: float = 1e-3, seed: int = 0) -> list[torch.Tensor]:
    """``n`` replicas of one part: a common weight tensor plus small per-replica drift (as after a few local steps)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=g) * 0.02
    return [base + spread * torch.randn(size, generator=g) for _ in range(n)]


def radius(parts: list[torch.Tensor], own: int | None, bound: PartBound, spread: float = 3.0) -> float:
    """``tau`` as the rule computes it (for the bounds the tests check)."""
    stack = torch.stack([p.double() for p in parts])
    voters = stack
    if len(parts) % 2 == 0 and own is not None:
        voters = torch.cat([stack, stack[own].unsqueeze(0)])
    center = voters.median(dim=0).values
    distances = torch.linalg.vector_norm(stack - center, dim=1).sort().values
    tau = bound.of(center)
    return min(tau, spread * float(distances[len(parts) // 2])) if len(parts) >= 3 else tau


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_agreeing_parts_give_the_plain_mean(n):
    parts = honest(n)
    result, clipped = centered_clip(parts, own=0, bound=LOOSE, spread=3.0)
    assert not any(clipped)
    assert torch.allclose(result, torch.stack(parts).mean(0), rtol=0, atol=1e-7)
    # parts alike to the last bit stay so (a round right after another)
    same, _ = centered_clip([parts[0].clone() for _ in range(n)], own=0, bound=LOOSE, spread=3.0)
    assert torch.equal(same, parts[0])


@pytest.mark.parametrize("n", [3, 4, 5, 8])
@pytest.mark.parametrize("far", [1.0, 10.0, 1e6, 1e30])
def test_one_far_part_moves_the_result_at_most_what_the_rule_allows(n, far):
    parts = honest(n - 1, seed=n)
    honest_mean = torch.stack(parts).mean(0)
    g = torch.Generator().manual_seed(7)
    direction = torch.randn(parts[0].shape, generator=g)
    bad = parts[0] + far * direction / direction.norm()
    everyone = [*parts, bad]
    result, clipped = centered_clip(everyone, own=0, bound=LOOSE, spread=3.0)
    assert clipped[-1] and not any(clipped[:-1])
    tau = radius(everyone, 0, LOOSE)
    # the far part, clipped to norm tau, moves the result at most 2 tau / n from what an honest part there would give
    as_if_honest, _ = centered_clip([*parts, parts[0]], own=0, bound=LOOSE, spread=3.0)
    assert float((result - as_if_honest).norm()) <= 2 * tau / n + 1e-9
    # and tau comes from the honest parts' own spread: the result stays by their mean, whatever the far part held
    spread = max(float((p - honest_mean).norm()) for p in parts)
    assert float((result - honest_mean).norm()) <= 3 * spread
    plain = torch.stack(everyone).mean(0)  # what hivemind's mean would have given
    if far >= 10:
        assert float((plain - honest_mean).norm()) > 20 * float((result - honest_mean).norm())


def test_a_pair_keeps_within_the_bound_of_the_reducers_own_part():
    """Two replicas: nobody can tell which is right, so the reducer's own part is the center and the other may pull
    it by at most half the a-priori bound (for weights: the slack replicas drift apart by between rounds)."""
    own, other = honest(2, spread=1e-4)
    bound = PartBound(relative=0.0, absolute=1e-3)
    result, clipped = centered_clip([own, other], own=0, bound=bound, spread=3.0)
    assert not any(clipped) and torch.allclose(result, (own + other) / 2, rtol=0, atol=1e-8)
    tau = bound.of(own)
    for far in (1.0, 1e4, 1e30):
        bad = own + far
        result, clipped = centered_clip([bad, own], own=1, bound=bound, spread=3.0)
        assert clipped == [True, False]
        assert float((result.double() - own.double()).norm()) <= tau / 2 * (1 + 1e-6)


def test_non_finite_parts_are_left_out():
    parts = honest(3)
    for poison in (float("nan"), float("inf")):
        bad = parts[0].clone()
        bad[17] = poison
        result, clipped = centered_clip([*parts, bad], own=0, bound=LOOSE, spread=3.0)
        assert clipped == [False, False, False, True] and bool(torch.isfinite(result).all())
        assert torch.allclose(result, torch.stack(parts).mean(0), rtol=0, atol=1e-7)


def test_the_rule_by_tensor_index():
    rule = ClipRule.for_weights(2, 6, slack=0.01)
    assert rule.bound(0) == rule.bound(1) == PartBound(relative=0.0, absolute=0.01)
    assert rule.bound(2).relative == 1.0 and rule.bound(5) == rule.bound(99) == rule.bound(-1) == rule.default


def test_the_part_reducer_as_hivemind_drives_it():
    """Three senders, three parts sent concurrently and out of order (as hivemind's streams deliver them), then a
    sender that fails after its first part: every sender gets the same reduction of each part, far values clipped,
    and the parts after the failure are reduced without the failed sender."""
    shapes = (torch.Size([512]), torch.Size([512]), torch.Size([100]))
    g = torch.Generator().manual_seed(3)
    values = [[torch.randn(s, generator=g) * 0.02 for s in shapes] for _ in range(3)]
    for k in range(3):  # senders 0 and 1 near one another, sender 2 far away
        values[1][k] = values[0][k] + 1e-4 * torch.randn(shapes[k], generator=g)
        values[2][k] = values[0][k] + 50.0

    async def drive(fail_after: int | None) -> list[list[torch.Tensor | None]]:
        reducer = RobustPartReducer(shapes, 3, rule=ClipRule(), own_sender=0, part_tensors=[0, 0, 1])
        out: list[list[torch.Tensor | None]] = [[None] * 3 for _ in range(3)]

        async def send(sender: int) -> None:
            for k in range(3):
                if sender == 2 and fail_after is not None and k == fail_after:
                    reducer.on_sender_failed(2)
                    return
                await asyncio.sleep(0)  # let the senders interleave
                out[sender][k] = await reducer.accumulate_part(sender, k, values[sender][k])

        await asyncio.gather(*(send(s) for s in (2, 0, 1)))
        assert reducer.finished.is_set() and reducer.clipped[2] == (3 if fail_after is None else fail_after)
        return out

    out = asyncio.run(drive(None))
    for k in range(3):
        expected, _ = centered_clip([v[k] for v in values], own=0, bound=ClipRule().bound(0), spread=3.0)
        assert all(torch.equal(out[s][k], expected) for s in range(3))
        assert float((expected - (values[0][k] + values[1][k]) / 2).norm()) < 1e-2
    out = asyncio.run(drive(1))
    assert out[2][1] is None and torch.equal(out[0][0], out[2][0])
    for k in (1, 2):  # a pair left: centered on the reducer's own part, the other within half the bound
        expected, _ = centered_clip([values[0][k], values[1][k]], own=0, bound=ClipRule().bound(0), spread=3.0)
        assert torch.equal(out[0][k], expected) and torch.equal(out[1][k], expected)
