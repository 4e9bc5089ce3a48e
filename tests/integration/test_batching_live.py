"""Continuous batching through real servers: sixteen sessions of different lengths, widths and sampling seeds, half
of them joining while the others decode, one server killed mid-batch, give the logits and tokens they give one at a
time (and Hugging Face's), and the servers' batch-size metric shows that their steps ran together."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from swarm.client.executor import Context
from swarm.client.session.inference_session import InferenceSession
from tests.helpers.models import local_reference
from tests.helpers.swarms import connect, patient_timing, running_swarm, scrape

pytestmark = pytest.mark.slow
STEPS = 10
SESSIONS = 16


@dataclass
class Run:
    """What one session produced: every step's last-position logits and the tokens picked."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)
    failovers: int = 0


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 320, (3 + 2 * i,), generator=g).tolist() for i in range(SESSIONS)]


def _decode(model, prompt: list[int], i: int, seen: dict[int, set[str]], after=None) -> Run:
    """Session ``i``: width 2 for every fourth (two sampled continuations of one prompt), greedy for even ``i``,
    sampled with its own seed for odd ``i``. ``after`` (step, callback): called once that many steps ran."""
    width = 2 if i % 4 == 3 else 1
    rng = torch.Generator().manual_seed(100 + i)
    run = Run()
    session = InferenceSession(
        model.connection, model.blocks.delivery, len(prompt) + STEPS + 1, width, model.runner.shape, model.runner.plans
    )
    try:
        new = torch.tensor([prompt] * width)
        for step in range(STEPS):
            with torch.inference_mode():
                logits = model.runner.session_step(session, new, Context(None, None), 0)[:, -1, :]
            seen[i] = {h.peer_id for h in session.route}
            if i % 2 == 0:
                tokens = logits.argmax(dim=-1)
            else:
                tokens = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=rng).squeeze(1)
            run.logits.append(logits)
            run.tokens.append(tokens)
            new = tokens[:, None]
            if after is not None and step + 1 == after[0]:
                after[1]()
        run.failovers = session.failovers
    finally:
        session.close()
    return run


def test_sixteen_mixed_sessions_batched_equal_each_alone_and_hugging_face(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    prompts = _prompts()
    with running_swarm(folder, ["0:2", "2:4", "2:4"], "--metrics-port", "0") as swarm:
        first = swarm.peers[0]
        with connect(folder, swarm, timing=patient_timing()) as model:
            seen: dict[int, set[str]] = {}
            killed: list[str] = []
            second_wave = threading.Event()

            def kill_mine() -> None:  # the 2:4 server of the last session (6 steps to go), by PID, mid-batch
                victim = next(p for p in swarm.peers[1:] if p.peer_id in seen[SESSIONS - 1])
                killed.append(victim.peer_id)
                swarm.kill(victim)

            def job(i: int) -> Run:
                if i >= SESSIONS // 2:  # the second half joins while the first half decodes
                    assert second_wave.wait(300)
                after = (3, second_wave.set) if i == 0 else (4, kill_mine) if i == SESSIONS - 1 else None
                return _decode(model, prompts[i], i, seen, after)

            with ThreadPoolExecutor(SESSIONS) as pool:
                together = list(pool.map(job, range(SESSIONS)))
            assert killed and together[-1].failovers >= 1  # it was replayed on the other 2:4 server
            metrics = scrape(first.urls["metrics"])
            rows, forwards = metrics[("swarm_peer_batch_rows_sum", ())], metrics[("swarm_peer_batch_rows_count", ())]
            assert rows > forwards  # the first server, on every session's route, ran steps of several together
            alone = [_decode(model, prompts[i], i, {}) for i in range(SESSIONS)]  # one at a time: no batch
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert (la - lb).abs().max().item() < 1e-5, f"session {i}"
        assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens, strict=True)), f"session {i}"
        # Hugging Face on each row's whole sequence gives the logits every step saw
        seqs = torch.cat([torch.tensor([prompts[i]] * len(a.tokens[0])), torch.stack(a.tokens, dim=1)], dim=1)
        with torch.no_grad():
            want = ref(seqs).logits[:, len(prompts[i]) - 1 : -1]
        got = torch.stack(a.logits, dim=1)
        assert (got - want).abs().max().item() < 1e-4, f"session {i}"
