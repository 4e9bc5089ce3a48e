"""Chained training passes through real stage servers (``swarm/client/passes/chained.py``, ``peers/rpc/passes.py``):
a micro-batch's forward goes stage to stage and its backward back, the trainer sending only the first hop's input;
the losses equal the client-mediated run's, and a stage killed mid-run costs a fallback, not the run."""

from __future__ import annotations

import pytest

from swarm.client.training.trainer import Trainer
from swarm.codecs import Codec
from swarm.config import Timing
from swarm.training.data import Samples
from swarm.training.run import load_run
from tests.helpers.runs import close_all, write_run
from tests.helpers.swarms import running_swarm

pytestmark = pytest.mark.slow
STEPS = 4


def _train(run_file, corpus, chain: bool) -> tuple[list[float], int]:
    run = load_run(run_file)
    data = Samples(corpus, run.seq_len, run.seed)
    spans = [str(s) for s in run.stages]
    with running_swarm("tiny-llama", spans, "--train", str(run_file)) as swarm:
        with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing.for_tests(), chain=chain) as trainer:
            trainer.model.connection.remote.codec = Codec.none  # exact activations both ways, as passes send them
            losses = [trainer.train_step() for _ in range(STEPS)]
            assert trainer.model.failovers == 0
            sent = trainer.model.connection.remote.traffic["sent_bytes"]
    return losses, sent


def test_chained_passes_equal_client_mediated_ones(tmp_path, corpus_ids):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    settings = dict(checkpoint={"every_steps": 0}, averaging={"every_steps": 0})
    chained, chained_sent = _train(write_run(tmp_path / "a", **settings), corpus_ids, chain=True)
    mediated, mediated_sent = _train(write_run(tmp_path / "b", **settings), corpus_ids, chain=False)
    assert close_all(chained, mediated, 1e-6), (chained, mediated)
    assert chained[-1] < chained[0]
    # the trainer sent each micro-batch's input once and its output gradient once, not three times each
    assert chained_sent < 0.5 * mediated_sent, (chained_sent, mediated_sent)


def test_a_stage_killed_mid_run_costs_a_fallback_not_the_run(tmp_path, corpus_ids):
    run_file = write_run(
        tmp_path,
        stages={"spans": ["0:3", "3:6"]},
        checkpoint={"every_steps": 0},
        averaging={"every_steps": 0},
    )
    run = load_run(run_file)
    data = Samples(corpus_ids, run.seq_len, run.seed)
    with running_swarm("tiny-llama", ["0:3", "0:3", "3:6"], "--train", str(run_file)) as swarm:
        with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing.for_tests()) as trainer:
            losses = [trainer.train_step() for _ in range(3)]
            victim = trainer.model.route[0].peer_id
            swarm.kill(swarm.peer_by_id(victim))
            losses += [trainer.train_step() for _ in range(4)]
            assert trainer.model.failovers >= 1
            assert victim not in {h.peer_id for h in trainer.model.route}
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
