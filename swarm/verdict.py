"""Is a server's output what honest servers compute? The rule every party applies alike (a client checking a hop, a
third server breaking a tie, another client or the broker re-running an accusation's evidence), and the schedule of
a client's checks.

Two honest servers of the same weights do not return the same bytes: another device, kernel, batch shape or a
prefill instead of single steps sum in another order. Measured on SmolLM2-135M (the numbers in ``Tolerance``'s
comments are from that calibration, re-measured by ``scripts/bench_verification.py``), for each position the
relative L2 distance between two honest outputs of one span is about 1e-6 in float32 and up to 3.4e-2 in bfloat16
(rounding to 8 significant bits, several times over); the root mean square over a window of positions is steadier:
at most 1.03e-2 in bfloat16. A cheat moves it further: 1e-2 relative noise adds 1e-2 in quadrature, 4-bit weights
5e-2 to 0.3, another block's weights O(1), garbage in one position O(1) there.

The client holds both outputs whole (it received the hop's and the verifier's), so it compares the tensors
themselves, position by position, rather than features of them: a relative L2 distance per position bounds every
direction at once, where top-k magnitudes or a few projections would miss noise outside them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import torch


class Local(Protocol):
    """A reader's own run of blocks ``start:end`` over ``inputs`` (at ``positions``; None: 0 on) for the weights of
    ``fingerprint``, to judge accusations and disputes by (None: it holds no such weights);
    ``swarm.families.recompute.local_judge`` makes one."""

    def __call__(
        self, inputs: torch.Tensor, start: int, end: int, fingerprint: str, positions: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class Tolerance:
    """How far two honest outputs of a span may be apart: ``rms``, the root mean square over a window's positions
    of each position's relative L2 distance, and ``worst``, that distance at any one position."""

    rms: float
    worst: float


# float32: 1e-6 measured on one CPU; 2e-3 leaves room for GPUs that multiply float32 in TF32 (~1e-3 relative).
# One position may not stray past 5e-3: a cheat on one step of a long window (noise of 1e-2 on 10% of steps) is
# diluted in the window's rms (1e-2 / sqrt(31) < 2e-3) and must be caught by its position.
# bfloat16/float16: 1.03e-2 (window) and 3.4e-2 (one position) measured between honest bfloat16 runs and float32;
# at 2.5x and 3x that, 1e-2 noise on a bfloat16 server is inside the honest spread (it is ~2.5 of its rounding steps)
# and passes; 4-bit weights, another block's weights and a garbage position do not.
FLOAT32 = Tolerance(rms=2e-3, worst=5e-3)
HALF = Tolerance(rms=2.5e-2, worst=1e-1)
# a hop whose activations crossed a lossy codec (float16, 8-bit: ``swarm.codecs``) took in and gave out rounded
# values the verifier never saw: 8-bit rounding alone is ~1e-2 of a value; no accusation is made over such a link
LOSSY = Tolerance(rms=6e-2, worst=2.5e-1)


def tolerance(*dtypes: str) -> Tolerance:
    """The tolerance between outputs computed in ``dtypes`` (the least precise decides)."""
    return FLOAT32 if all(d == "float32" for d in dtypes) else HALF


@dataclass(frozen=True)
class Comparison:
    rms: float
    worst: float
    worst_position: int  # index into the window's positions (sequence axis)
    finite: bool

    def within(self, tol: Tolerance) -> bool:
        return self.finite and self.rms <= tol.rms and self.worst <= tol.worst

    def describe(self) -> str:
        if not self.finite:
            return "non-finite values"
        return f"relative distance {self.rms:.2e} (window rms), {self.worst:.2e} at position {self.worst_position}"


def compare(out: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """How far ``out`` is from ``ref`` (both [batch, positions, hidden]), position by position."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes {tuple(out.shape)} and {tuple(ref.shape)} differ")
    a, b = out.detach().float(), ref.detach().float()
    finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
    if not finite or a.numel() == 0:
        return Comparison(0.0, 0.0, 0, finite)
    # relative to the reference's size at that position; a zero vector (never an honest hidden state) counts whole
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)  # [batch, positions]
    per_position = rel.max(dim=0).values
    worst = int(per_position.argmax())
    return Comparison(float(rel.pow(2).mean().sqrt()), float(per_position[worst]), worst, True)


def agree(out: torch.Tensor, ref: torch.Tensor, *dtypes: str) -> bool:
    return compare(out, ref).within(tolerance(*dtypes))


class Gaps:
    """When a client checks a hop next: after a number of steps drawn uniformly from 1 to ``2 * mean - 1`` (so at
    most that many steps pass unchecked, and a server cannot tell which step closes a window). ``mean`` 0: never."""

    def __init__(self, mean: int, rng: random.Random) -> None:
        self.mean, self.rng = mean, rng

    def draw(self) -> int:
        if self.mean <= 0:
            return 1 << 62
        return self.rng.randint(1, 2 * self.mean - 1)
