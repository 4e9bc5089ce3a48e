"""A pre-training stage without a swarm (``stage``: a span trainer of the shipped tiny run, its proofs checked) and
a trainer's signed word on its progress (``proof``): what the tests of the stage's integrity and of its limits give
it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from hivemind.utils.crypto import RSAPrivateKey

from peers.training.proofs import StepProofs
from peers.training.span_trainer import SpanTrainer
from swarm.dht import dht_time
from swarm.identity import Signed, peer_id_of_key, sign_record
from swarm.ids import Span
from swarm.model_files import new_model
from swarm.records import TrainerProgress
from swarm.training.run import RunConfig, load_run
from tests.helpers.runs import SHIPPED

STAGE = Span(0, 2)
KEY = RSAPrivateKey()  # the trainer whose signed progress ``proof`` makes by default


def stage(tmp_path: Path, **changes: object) -> SpanTrainer:
    run: RunConfig = dataclasses.replace(load_run(SHIPPED), **changes)  # type: ignore[arg-type]
    model = new_model(run.hf_config(), torch.float32)
    t = SpanTrainer(run, torch.nn.ModuleList(model.model.layers[STAGE.start : STAGE.end]), STAGE, tmp_path)
    t.proofs = StepProofs(run, max_age=60.0, skew=2.0)
    return t


def proof(step: int, key: RSAPrivateKey = KEY, age: float = 0.0, trainer: str | None = None) -> Signed:
    me = trainer or peer_id_of_key(key.get_public_key().to_bytes())
    return sign_record(key, TrainerProgress(trainer=me, step=step, samples=0, updated=dht_time() - age))
