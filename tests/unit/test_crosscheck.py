"""The trainer's cross-check of replicas (``swarm/client/training/crosscheck.py``), its pure parts with real
tensors: a real block's outputs and input gradients under float32 rounding against a replica that cheats by 1%, and
who is banned for which disagreement."""

from __future__ import annotations

import torch

from swarm.client.training.crosscheck import Reply, divergence, verdict

TOL = 1e-3


def block_replies(seed: int = 0) -> tuple[Reply, Reply, Reply]:
    """One real MLP block run three times: as computed, with its weights perturbed by float32 rounding (an averaging
    round leaves replicas equal only up to that), and with its output scaled by 1% (a cheat)."""
    torch.manual_seed(seed)
    block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(2, 16, 64)
    grad = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed + 1))

    def run(name: str, noise: float, cheat: float) -> Reply:
        copy = [p.detach().clone() for p in block.parameters()]
        with torch.no_grad():
            for p in block.parameters():
                p.mul_(1 + noise * torch.randn_like(p))
        xi = x.clone().requires_grad_(True)
        out = block(xi) * (1 + cheat)
        (g,) = torch.autograd.grad(out, xi, grad)
        with torch.no_grad():
            for p, c in zip(block.parameters(), copy, strict=True):
                p.copy_(c)
        return Reply(name, out.detach(), g)

    return run("a", 0.0, 0.0), run("b", 1e-7, 0.0), run("liar", 0.0, 1e-2)


def test_rounding_differences_pass_and_a_one_percent_cheat_does_not():
    a, b, liar = block_replies()
    honest = max(divergence(a.hidden, b.hidden), divergence(a.grad_input, b.grad_input))
    cheat = divergence(a.hidden, liar.hidden)
    assert honest < 1e-5 < TOL < cheat
    assert divergence(a.hidden, a.hidden[:, :8]) == float("inf")  # another shape never agrees
    nan = a.hidden.clone()
    nan[0, 3, 5] = float("nan")
    assert divergence(a.hidden, nan) == float("inf")
    zeros = torch.zeros(3, 4)
    assert divergence(zeros, zeros) == 0.0


def test_who_is_banned():
    a, b, liar = block_replies()
    assert verdict([a, b], TOL) == (frozenset(), True)
    assert verdict([a, b, liar], TOL) == (frozenset({"liar"}), True)
    assert verdict([liar, a, b], TOL) == (frozenset({"liar"}), True)
    # two replicas that disagree: the trainer cannot tell which is right, and bans neither
    assert verdict([a, liar], TOL) == (frozenset(), False)
    # three that all disagree: nothing settled either
    _, _, other = block_replies(seed=1)
    worse = Reply("worse", liar.hidden * 1.05, liar.grad_input)
    assert verdict([a, liar, worse], TOL) == (frozenset(), False)
    assert verdict([a, Reply("other", other.hidden, other.grad_input), liar], TOL)[1] is False
