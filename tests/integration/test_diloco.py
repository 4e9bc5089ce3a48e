"""DiLoCo through real peers (``[averaging] method = "diloco"``): with one replica per stage the swarm equals one
process running DiLoCo (inner AdamW, the outer Nesterov step every ``every_steps``), and replicas of a stage that
trained on different micro-batches end every round with the same weights and outer momentum, sending their top-k
pseudo-gradients at 8 bits."""

from __future__ import annotations

import pytest
import torch

from swarm.client.training.local import LocalTraining
from swarm.client.training.trainer import Trainer
from swarm.config import Timing
from swarm.errors import BadInputError, BusyError
from swarm.hop import Hop
from swarm.records import stage_servers
from swarm.training.data import Samples
from swarm.training.init import stage_state_bytes
from swarm.training.run import load_run
from tests.helpers.runs import close_all, write_run
from tests.helpers.swarms import patient_timing, running_swarm, wait_for

pytestmark = pytest.mark.slow


def test_one_replica_per_stage_equals_one_process_diloco(tmp_path, corpus_ids):
    run_file = write_run(
        tmp_path,
        checkpoint={"every_steps": 0},
        averaging={"method": "diloco", "every_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.9},
    )
    run = load_run(run_file)
    data = Samples(corpus_ids, run.seq_len, run.seed)
    local = LocalTraining(run, data)
    expected = [local.train_step() for _ in range(6)]
    spans = [str(s) for s in run.stages]
    with running_swarm("tiny-llama", spans, "--train", str(run_file)) as swarm:
        with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing.for_tests()) as trainer:
            ours = [trainer.train_step() for _ in range(6)]
    assert close_all(ours, expected), (ours, expected)
    # the outer steps changed the curve: plain AdamW's differs after the first round
    plain = LocalTraining(load_run(write_run(tmp_path, averaging={"every_steps": 0})), data)
    plain_losses = [plain.train_step() for _ in range(6)]
    assert close_all(plain_losses[:3], expected[:3]) and not close_all(plain_losses[3:], expected[3:], 1e-3)


def _round_states(trainer: Trainer, run, stage) -> list[tuple[int, dict[str, torch.Tensor]]]:
    conn = trainer.model.connection
    view = conn.store.view(run.model_id, run.stages[-1].end)
    states = []
    for record in {r.peer_id: r for r in stage_servers(view, stage, run.fingerprint)}.values():
        hop = Hop.of(record, stage.start, stage.end)
        limit = stage_state_bytes(run, stage)
        reply, tensors = conn.loop.run(conn.remote.state(hop, 30.0, limit, last_round=True))
        states.append((reply.step, tensors))
    return states


def _agree_at(trainer: Trainer, run, step: int) -> bool:
    """Every stage's replicas ended the round of ``step`` with the same weights and outer momentum."""
    for stage in run.stages:
        try:
            states = _round_states(trainer, run, stage)
        except (BusyError, BadInputError):  # a copy still being sent, or a round not ended yet: at the next poll
            return False
        if len(states) < 2 or any(s != step for s, _ in states):
            return False
        first = states[0][1]
        assert {k.split(".", 1)[0] for k in first} == {"param", "outer_m"}
        for _, other in states[1:]:
            if any((first[k] - other[k]).abs().max().item() > 1e-6 for k in first):
                return False
    return True


def test_replicas_end_each_round_with_the_same_outer_step(tmp_path, corpus_ids):
    run_file = write_run(
        tmp_path,
        stages={"spans": ["0:3", "3:6"]},
        checkpoint={"every_steps": 0},
        averaging={
            "method": "diloco",
            "every_steps": 4,
            "compression": "topk",
            "density": 0.05,
            "matchmaking_seconds": 1.0,
        },
        batch={"target_batch_size": 32},
    )
    run = load_run(run_file)
    data = Samples(corpus_ids, run.seq_len, run.seed)
    with running_swarm("tiny-llama", ["0:3", "0:3", "3:6", "3:6"], "--train", str(run_file)) as swarm:
        with Trainer(run, data, tuple(swarm.initial_peers), timing=patient_timing(), wiring_seed=0) as trainer:
            losses = []
            for step in range(1, 13):
                losses.append(trainer.train_step())
                if step % 4 == 0:
                    wait_for(lambda s=step: _agree_at(trainer, run, s), 40, f"the outer step of round {step}")
            used = {peer for peer, _ in trainer.model.connection.view.speeds}
    assert len(used) == 4  # both replicas of each stage trained on micro-batches of their own
    assert losses[-1] < losses[0] - 0.5, losses  # and the run learns
