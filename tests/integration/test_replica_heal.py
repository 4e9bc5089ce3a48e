"""Replicas of a stage that are apart are found and healed, on a real swarm: one replica of stage 0:3 is a real peer
whose weights go wrong once (``harness/drift.py``: every weight moved by 0.5 right after its step 3). At its next
averaging round it finds its own weights beyond what AdamW could have moved them since its last accepted round, sits
the round out, takes the other replica's state (checked against the digest that replica sent with it), and the two
end the following rounds equal; the heal is in its metrics, the honest replica takes nothing, and the run keeps
learning. Then the honest replica is frozen while the run goes on without it, and once thawed it takes the other's
state and averages with it again."""

from __future__ import annotations

import signal

import torch

from swarm.client.training.trainer import Trainer
from swarm.config import Timing
from swarm.hop import Hop
from swarm.ids import Span
from swarm.training.data import Samples, corpus_files, tokenize
from swarm.training.init import stage_state_bytes
from swarm.training.run import load_run
from swarm.training.state import agree
from tests.helpers.runs import write_run
from tests.helpers.swarms import counter, running_swarm

MAX_STEPS = 30  # corrupted after step 3, found at the round of step 4, healed, equal after a round or two
REJOIN_STEPS = 20  # steps for a replica the run left behind to average with the others again
LEARN_STEPS = 20  # and the run keeps learning: its loss at step 20 below its first


def round_state(trainer: Trainer, peer_id: str, stage: Span) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The state ``peer_id`` ended its last averaging round with (None before its first)."""
    conn = trainer.model.connection
    records = [r for rs in conn.store.view(trainer.run.model_id, stage.end).values() for r in rs]
    record = next(r for r in records if r.peer_id == peer_id)
    limit = stage_state_bytes(trainer.run, stage)
    try:
        reply, tensors = conn.loop.run(conn.remote.state(Hop.of(record, stage.start, stage.end), 30.0, limit, True))
    except Exception:  # "this replica has not ended an averaging round yet"
        return None
    return reply.step, tensors


def test_a_replica_whose_weights_went_wrong_takes_the_others_state_and_they_agree_again(tmp_path):
    run_file = write_run(
        tmp_path,
        stages={"spans": ["0:3", "3:6"]},
        checkpoint={"every_steps": 0},
        averaging={"every_steps": 2, "matchmaking_seconds": 1.0},
    )
    run = load_run(run_file)
    stage = run.stages[0]
    data = Samples(tokenize(corpus_files(None), "bytes", 256), run.seq_len, run.seed)
    logs = tmp_path / "logs"  # kept for a post-mortem (pytest keeps the last three runs)
    with running_swarm(
        "tiny-llama", ["0:3", "3:6"], "--train", str(run_file), "--metrics-port", "0", log_dir=logs
    ) as swarm:
        honest = swarm.peers[0]
        drifter = swarm.add_peer("0:3", "--drift-at", "3", main="harness.drift")
        with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing.for_tests()) as trainer:
            losses, together = [], None
            for _ in range(MAX_STEPS):
                losses.append(trainer.train_step())
                if counter(swarm, "swarm_peer_replica_heals")[drifter.peer_id] < 1:
                    continue
                mine, theirs = round_state(trainer, drifter.peer_id, stage), round_state(trainer, honest.peer_id, stage)
                if mine is not None and theirs is not None and mine[0] == theirs[0] > 4 and agree(mine[1], theirs[1]):
                    together = mine
                    break
            heals = counter(swarm, "swarm_peer_replica_heals")
            undone = counter(swarm, "swarm_peer_rounds_undone")
            assert together is not None, f"not equal again within {MAX_STEPS} steps (heals {heals}, undone {undone})"
            # Then the run goes on without the honest replica (frozen: its rounds cannot form, the trainer's requests
            # to it time out) for more steps than one trainer's word moves a stage. Thawed, it must take the other's
            # state and average with it again: at stop 67 such a replica refused every request for good.
            honest.proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(run.catch_up_limit + 3):
                    losses.append(trainer.train_step())
            finally:
                honest.proc.send_signal(signal.SIGCONT)
            left_at, back = trainer.step, None
            for _ in range(REJOIN_STEPS):
                losses.append(trainer.train_step())
                mine, theirs = round_state(trainer, honest.peer_id, stage), round_state(trainer, drifter.peer_id, stage)
                if mine is not None and mine[0] > left_at and theirs is not None and mine[0] == theirs[0]:
                    back = mine[0] if agree(mine[1], theirs[1]) else None
                    if back is not None:
                        break
            while len(losses) < LEARN_STEPS:
                losses.append(trainer.train_step())
    assert back is not None, f"the replica left behind at step {left_at} did not average again by {trainer.step}"
    assert heals[drifter.peer_id] >= 1 and heals[honest.peer_id] == 0  # the one that was off took the copy
    weights = [t for name, t in together[1].items() if name.startswith("param.")]
    assert all(bool(torch.isfinite(w).all()) and float(w.abs().max()) < 10 for w in weights)
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
