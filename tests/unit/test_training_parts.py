"""Pre-training pieces without a swarm: run configs, the schedule, per-tensor seeded initialisation, the data order,
stochastic wiring of micro-batches, stage placement."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from peers.broker.planner import PeerInfo, Role
from peers.broker.stages import plan_stages
from peers.training.span_trainer import SpanTrainer
from swarm import wire
from swarm.client.routing import choose_route
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.model_files import new_model
from swarm.training.data import Samples
from swarm.training.init import init_full_model, init_module, stage_state_bytes
from swarm.training.run import load_run
from tests.helpers.records import record

SHIPPED = Path(__file__).parents[2] / "configs" / "runs" / "tiny-llama.toml"


def test_run_config_and_schedule(tmp_path):
    run = load_run(SHIPPED)
    assert run.stages == (Span(0, 2), Span(2, 4), Span(4, 6)) and run.target_batch_size == 16
    assert run.averaging_request_timeout == 1.0 < run.matchmaking_seconds and run.averaging_timeout == 10.0
    assert load_run("tiny-llama").name == run.name  # by name, from the package's configs
    assert run.lr_factor(0) == pytest.approx(0.1) and run.lr_factor(9) == pytest.approx(1.0)
    assert run.lr_factor(10) == pytest.approx(1.0) and run.lr_factor(run.total_steps) == pytest.approx(0.0)
    text = SHIPPED.read_text()
    for bad, message in (
        (text.replace('spans = ["0:2", "2:4", "4:6"]', 'spans = ["0:2", "3:6"]'), "without gaps"),
        (text.replace("micro_batch_size = 8", "micro_batch_size = 5"), "multiple of micro_batch_size"),
        (text.replace('kind = "cosine"', 'kind = "linear"'), "schedule.kind: Input should be 'constant' or 'cosine'"),
        (text.replace('name = "tiny-llama-pretrain"', 'name = "a b"'), "name: String should match pattern"),
        (text.replace("lr = 3e-3", "lr = -1"), "optimizer.lr: Input should be greater than 0"),
        (text.replace("[batch]", "[batch]\nsurprise = 1"), "batch.surprise: Extra inputs are not permitted"),
        (  # hivemind's matchmaking can deadlock when a message may take as long as the period
            text.replace("matchmaking_seconds = 2.0", "matchmaking_seconds = 2.0\nrequest_timeout = 2.0"),
            r"request_timeout \(2 s\) must be shorter than averaging.matchmaking_seconds",
        ),
    ):
        path = tmp_path / "bad.toml"
        path.write_text(bad)
        with pytest.raises(BadInputError, match=message):
            load_run(path)
    with pytest.raises(BadInputError, match="not one of them"):
        run.stage_of(Span(0, 3))
    assert run.hf_config()._attn_implementation == "sdpa"  # the family's choice (Llama's)
    gpt2 = tmp_path / "gpt2.toml"  # dropout on by default: no two processes draw its masks alike, so refused
    gpt2.write_text(text.replace('model_type = "llama"', 'model_type = "gpt2"'))
    with pytest.raises(BadInputError, match=r"run 'tiny-llama-pretrain' \(gpt2\): .*set attn_pdrop, embd_pdrop"):
        load_run(gpt2).hf_config()


def test_a_span_initialised_alone_equals_the_full_model():
    run = load_run(SHIPPED)
    config = run.hf_config()
    full = init_full_model(config, run.seed)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layer = LlamaDecoderLayer(config, layer_idx=3)
    init_module(layer, "model.layers.3.", config, run.seed)
    for name, param in layer.named_parameters():
        assert torch.equal(param, full.state_dict()[f"model.layers.3.{name}"]), name
    assert torch.equal(full.model.layers[3].input_layernorm.weight, torch.ones(64))
    assert not torch.equal(full.model.layers[2].mlp.up_proj.weight, full.model.layers[3].mlp.up_proj.weight)
    other = init_full_model(config, run.seed + 1)
    assert not torch.equal(other.lm_head.weight, full.lm_head.weight)


def test_samples_are_reproducible_and_addressed_by_position():
    ids = torch.arange(1000) % 256
    a, b = Samples(ids, 10, seed=3), Samples(ids, 10, seed=3)
    assert torch.equal(a.batch(0, 16), torch.cat([b.batch(0, 8), b.batch(8, 8)]))
    assert torch.equal(a.batch(95, 10), b.batch(95, 10))  # across the epoch boundary (100 samples)
    first_epoch = a.batch(0, 100)
    assert sorted(first_epoch[:, 0].tolist()) == sorted(a.windows[:, 0].tolist())  # each sample once per epoch
    assert not torch.equal(Samples(ids, 10, seed=4).batch(0, 8), a.batch(0, 8))


def test_micro_batches_are_wired_to_replicas_in_proportion_to_speed():
    fast = record(peer_id="fast", start=0, end=4, forward_tps=300.0)
    slow = record(peer_id="slow", start=0, end=4, forward_tps=100.0)
    assert choose_route([fast, slow], 0, 4, mode="forward")[0].peer_id == "fast"  # without noise: always fast
    rng = random.Random(0)
    picks = [
        choose_route(
            [fast, slow],
            0,
            4,
            mode="forward",
            default_latency=0.0,
            noise={"fast": rng.expovariate(1.0), "slow": rng.expovariate(1.0)},
        )[0].peer_id
        for _ in range(2000)
    ]
    assert 0.70 < picks.count("fast") / len(picks) < 0.80  # 3 : 1


def test_stage_placement_balances_and_keeps_stages():
    stages = (Span(0, 2), Span(2, 4), Span(4, 6))
    gb = 1 << 30
    peers = [
        PeerInfo("pinned", 10.0, 10 * gb, pinned=Span(0, 2), span=Span(0, 2), role=Role.SERVE),
        PeerInfo("serving", 10.0, 10 * gb, span=Span(2, 4), role=Role.SERVE),
        PeerInfo("new-fast", 30.0, 10 * gb),
        PeerInfo("new-slow", 5.0, 10 * gb),
        PeerInfo("tiny", 50.0, gb),  # room for one block only: no stage fits
    ]
    plan = plan_stages(peers, stages, block_bytes=gb)
    spans = {pid: (pl.span.start, pl.span.end) for pid, pl in plan.placements.items()}
    assert spans["pinned"] == (0, 2) and spans["serving"] == (2, 4)
    assert spans["new-fast"] == (4, 6)  # the empty stage first
    assert spans["new-slow"] == (0, 2)  # then the weakest (a tie with 2:4 goes to the earlier stage)
    assert plan.unplaceable == ("tiny",)
    assert plan.bottleneck == pytest.approx(5.0)


def test_a_stage_state_fits_the_bound_a_joiner_puts_on_it(tmp_path):
    run = load_run(SHIPPED)
    model = new_model(run.hf_config(), torch.float32)
    for stage in run.stages:
        layers = torch.nn.ModuleList(model.model.layers[stage.start : stage.end])
        state = SpanTrainer(run, layers, stage, tmp_path).export_state()
        size = wire.encoded_size(wire.encode({"ok": True, "step": 0}, state))
        assert size <= stage_state_bytes(run, stage) < 2 * size + (2 << 20)
