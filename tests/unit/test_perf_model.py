"""The performance model's pure parts: counts against a real Hugging Face model, the link model, plan pricing (chained
against client-mediated crossings), pipelines, the calibration record, and the validation rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.perf.validation import Row, finetune_rows, predict_rows, report, summary, table, wan_link
from swarm.hop import Hop
from swarm.perf.arch import Arch, context_of
from swarm.perf.calibration import Calibration, Hardware
from swarm.perf.model import INITIAL_WINDOW, Cost, Device, Link, Software, pipeline, price
from swarm.perf.predict import Swarm, decode_step, forward_time, pretrain_step, train_time, ttft, uniform
from swarm.plan.compile import Call, ModelShape, generate_plan, repair

SMALL = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    tie_word_embeddings=False,
)
FAST = Device("ideal", flops=1e18, bandwidth=1e18)  # work costs nothing: only links and software remain


def test_parameter_count_equals_hugging_face():
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        cfg = dict(SMALL, tie_word_embeddings=tied)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        assert Arch.from_config(cfg).params == sum(p.numel() for p in model.parameters())
        block = model.model.layers[0]
        assert Arch.from_config(cfg).block_params == sum(p.numel() for p in block.parameters())


def test_smollm2_counts():
    arch = Arch(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, head_dim=64, tied=True)
    assert arch.params == 134_515_008  # SmolLM2-135M's published parameter count
    assert arch.kv_bytes_per_token(2) == 2 * 192 * 2
    assert arch.block_flops(1, 0) == 2 * arch.block_linear_params  # attention of nothing costs nothing
    assert context_of(10, 1) == 11  # one new token attends to the 10 cached and itself


def test_slow_start():
    link = Link(delay=0.02, bandwidth=100e6 / 8)
    assert link.slow_start_rounds(INITIAL_WINDOW) == 0
    rounds = [link.slow_start_rounds(n) for n in (30_000, 100_000, 500_000, 5_000_000)]
    assert rounds == sorted(rounds) and rounds[0] >= 1
    assert Link(delay=0.02, bandwidth=100e6 / 8, warm=True).slow_start_rounds(5_000_000) == 0
    # the window stops growing at the bandwidth-delay product: a huge message is bandwidth-bound after that
    assert link.slow_start_rounds(1e9) == link.slow_start_rounds(1e8)
    t = link.time(1e6).comm
    assert t > 0.02 + 1e6 / link.bandwidth


def test_chained_steps_cross_each_link_once():
    arch = Arch.from_config(SMALL)
    for n in (1, 2, 3):
        spans = [(i, i + 1) for i in range(n)]
        sw = uniform(arch, spans, FAST, FAST, Link(delay=0.01), Software())
        assert decode_step(sw, 8, chained=True).comm == pytest.approx((n + 1) * 0.01)
        assert decode_step(sw, 8, chained=False).comm == pytest.approx(2 * n * 0.01)


def test_work_scales_with_blocks_and_tokens():
    arch = Arch.from_config(SMALL)
    dev = Device("d", flops=1e9, bandwidth=1e9, block_overhead=1e-4)
    local = Swarm(arch, dev)
    assert forward_time(local, 1, 256).total > forward_time(local, 1, 16).total
    one = uniform(arch, [(0, 3)], dev, dev, Link(), Software())
    three = uniform(arch, [(0, 1), (1, 2), (2, 3)], dev, dev, Link(), Software(call_hop=0.01))
    assert forward_time(three, 1, 16).total == pytest.approx(forward_time(one, 1, 16).total + 0.03)
    frozen = train_time(local, 1, 64, update=False).total
    assert train_time(local, 1, 64, client_params=10**6, update=False).total > frozen  # head's weight gradient
    assert ttft(three, 512).total > ttft(three, 128).total


def test_price_of_a_repaired_plan():
    shape = ModelShape("m", 3, 64, 300)
    plan = generate_plan(shape, [Hop("a", 0, 2), Hop("b", 2, 3)], Call(1, 1), max_length=8)
    fixed, _ = repair(plan, "s0", [Hop("c", 0, 1), Hop("d", 1, 2)], 1)
    arch = Arch.from_config(SMALL)
    sw = uniform(arch, [(0, 2), (2, 3)], FAST, FAST, Link(delay=0.01), Software())
    s = sw.setting(tokens=1, past=4)
    s = type(s)(**{**s.__dict__, "devices": {**s.devices, "c": FAST, "d": FAST, "a": FAST, "b": FAST}})
    assert price(fixed, s).cost.comm == pytest.approx(6 * 0.01)  # three servers, client-mediated
    assert price(fixed, type(s)(**{**s.__dict__, "chained": True})).cost.comm == pytest.approx(4 * 0.01)


def test_pipeline():
    a, b = Cost(compute=1.0), Cost(compute=3.0)
    assert pipeline([a, b], 1, 1).total == 4.0
    assert pipeline([a, b], 2, 1).total == 8.0  # one at a time
    assert pipeline([a, b], 2, 2).total == 7.0  # the second follows the slowest stage
    assert pipeline([a, b], 2, 2, cores=1).total == 8.0  # one core: no faster than the work
    assert pipeline([a, b], 2, 2, cores=1).bubble == 1.0


def test_pretraining_more_stages_cost_more_calls():
    arch = Arch.from_config(SMALL)
    dev = Device("d", flops=1e12, bandwidth=1e11)
    sw = Software(stage_call=0.005)
    two = uniform(arch, [(0, 2), (2, 3)], dev, dev, Link(), sw)
    three = uniform(arch, [(0, 1), (1, 2), (2, 3)], dev, dev, Link(), sw)
    assert pretrain_step(three, 16, 64, 8, 2).total > pretrain_step(two, 16, 64, 8, 2).total


def test_calibration_record_and_clamping(tmp_path):
    hw = Hardware(
        flops=1e11,
        attention_flops=4e10,
        bandwidth=1e10,
        elementwise_bandwidth=1e10,
        block_overhead=3e-4,
        backward_overhead=9e-4,
    )
    cal = Calibration(
        machine="m",
        threads=1,
        hardware=hw,
        transport_bandwidth=1e8,
        software={"step_hop": 0.002, "client_step": -0.001},
        measured_at=0.0,
    )
    again = Calibration.model_validate_json(cal.model_dump_json())
    assert again == cal
    assert again.costs().client_step == 0.0  # a negative difference of noisy timings is no cost
    assert again.device().attention_flops == 4e10
    with pytest.raises(ValueError):
        Calibration.model_validate({**cal.model_dump(), "version": 2})


def test_the_client_reads_the_newest_calibration_of_this_machine(tmp_path):
    from swarm.perf.calibration import cached_software, calibration_path, machine_key, save

    assert cached_software(tmp_path) is None  # never calibrated
    hw = Hardware(
        flops=1e11,
        attention_flops=4e10,
        bandwidth=1e10,
        elementwise_bandwidth=1e10,
        block_overhead=0,
        backward_overhead=0,
    )

    def cal(threads, step_hop, at, machine=None):
        return Calibration(
            machine=machine or machine_key(threads),
            threads=threads,
            hardware=hw,
            transport_bandwidth=1e8,
            software={"step_hop": step_hop},
            measured_at=at,
        )

    save(cal(1, 0.004, 1.0), calibration_path(tmp_path, 1))
    save(cal(2, 0.006, 2.0), calibration_path(tmp_path, 2))  # any thread count: the newest
    save(cal(3, 0.9, 3.0, "another CPU | torch 0 | 3 thread(s)"), tmp_path / "perf" / "calibration-other.json")
    got = cached_software(tmp_path)
    assert got is not None and got.step_hop == 0.006


def test_validation_rows_and_table(monkeypatch):
    hw = Hardware(
        flops=1e11,
        attention_flops=4e10,
        bandwidth=1e10,
        elementwise_bandwidth=1e10,
        block_overhead=3e-4,
        backward_overhead=9e-4,
    )
    cal = Calibration(machine="m", threads=1, hardware=hw, transport_bandwidth=1e8, software={}, measured_at=0.0)
    monkeypatch.setattr("harness.perf.validation.arch_of", lambda model: Arch.from_config(SMALL))
    data = {
        "args": {"model": "small", "spans": ["0:1", "1:3"], "batch": 2, "seq": 32, "rank": 8},
        "adapter_params": 1000,
        "local_step_s": 0.5,
        "swarm_step_s": 0.6,
    }
    rows = finetune_rows(cal, data, 2)
    assert [r.case.endswith("(swarm)") for r in rows] == [False, True]
    assert all(r.rate and r.predicted > 0 for r in rows)
    assert rows[1].error == pytest.approx(rows[1].predicted / (1 / 0.6) - 1)
    text = table(rows + [Row("b", "c", "s", 1.0, 2.0, Cost(comm=2.0), False)])
    assert "**miss**" in text and "| 100% |" in text
    # a WAN link is no faster than the transport, and a codec of fewer bytes per value makes it faster
    assert wan_link(cal, "a", "none").bandwidth < 1e8
    exact, block8 = wan_link(cal, "a", "none").time(1e6), wan_link(cal, "a", "block8").time(1e6)
    assert block8.comm < exact.comm and block8.software == exact.software == 0.0  # no codec costs calibrated here
    costly = cal.model_copy(update={"codecs": {"block8": (3e-4, 2e-8)}})
    assert wan_link(costly, "a", "block8").time(1e6).software == pytest.approx(3e-4 + 2e-2)
    assert math.isclose(wan_link(cal, "b", "none").delay, 0.05)


def test_validation_regimes_samples_and_cores(monkeypatch):
    """Rows behind emulated links are delay-bound, the rest compute-bound; a held-out run's rows are out-of-sample;
    the summary keeps the four groups apart (compute-bound first); the measured core count reaches the model."""
    hw = Hardware(
        flops=1e10,
        attention_flops=4e9,
        bandwidth=1e10,
        elementwise_bandwidth=1e10,
        block_overhead=3e-4,
        backward_overhead=9e-4,
    )
    cal = Calibration(machine="m", threads=1, hardware=hw, transport_bandwidth=1e8, software={}, measured_at=0.0)
    monkeypatch.setattr("harness.perf.validation.arch_of", lambda model: Arch.from_config(SMALL))
    wan = {
        "local": {"small": {"step_s": 0.01, "ttft_s": 0.2}},
        "spans": {"small": ["0:1", "1:2", "2:3"]},
        "results": [
            {"plane": "direct", "task": "ttft", "model": "small", "link": link, "mode": "chain=on", "ttft_s": 0.5}
            for link in ("loopback", "a")
        ],
    }
    ft = {
        "args": {"model": "small", "spans": ["0:1", "1:3"], "batch": 2, "seq": 32, "rank": 8},
        "adapter_params": 1000,
        "local_step_s": 0.5,
        "swarm_step_s": 0.6,
    }
    rows = predict_rows(cal, {"wan": wan, "heldout-finetune": ft, "unknown": {}}, cores=2)
    assert [(r.regime, r.sample) for r in rows] == [
        ("compute", "in"),  # the local decode step
        ("compute", "in"),  # the local time to first token
        ("compute", "in"),  # loopback
        ("delay", "in"),  # link a
        ("compute", "out"),
        ("compute", "out"),
    ]
    lines = summary(rows)
    assert [line.split(":")[0] for line in lines] == [
        "in-sample, compute-bound (one process or loopback)",
        "in-sample, delay-bound (behind emulated links)",
        "out-of-sample, compute-bound",
    ]
    assert lines[1].startswith("in-sample, delay-bound (behind emulated links): ") and " of 1 within" in lines[1]
    assert [Row.from_dict(r.as_dict()) for r in rows] == rows  # a record's rows read back as they were
    text = report(rows)
    assert text.index("In-sample, compute-bound") < text.index("In-sample, delay-bound") < text.index("Out-of")
    # chained prefill pieces pipelined through 3 servers: no faster than their work over the cores they share
    one, many = (predict_rows(cal, {"wan": wan}, cores=c)[2] for c in (1, 64))
    assert one.predicted > many.predicted


def test_the_docs_show_the_committed_validation_record():
    """docs/cost-model.md's validation summary and tables are the committed record's rows, rendered by
    ``scripts/validate_model.py --report`` (re-render them after a new run); the record holds what they came from."""
    root = Path(__file__).resolve().parents[2]
    records = sorted((root / "docs" / "perf").glob("validation-*.json"))
    assert records, "no validation record committed in docs/perf"
    record = json.loads(records[-1].read_text())
    rows = [Row.from_dict(r) for r in record["rows"]]
    assert record["summary"] == summary(rows)
    assert {(r.sample, r.regime) for r in rows} >= {("in", "compute"), ("in", "delay"), ("out", "compute")}
    page = (root / "docs" / "cost-model.md").read_text()
    assert records[-1].name in page
    assert report(rows) in page
    Calibration.model_validate(record["calibration"])
    assert record["machine"]["cores"] >= 1 and set(record["runs"]) == set(record["commands"])


def test_no_torch_needed_to_price():
    # pricing is pure arithmetic: the module works on tensors nowhere (a planner on a machine without torch)
    import swarm.perf.model as m

    assert "torch" not in m.__dict__
    assert torch.__version__  # the test process has torch; the model does not use it


def test_predict_report(monkeypatch):
    import argparse

    from swarm.perf.report import predict_report

    monkeypatch.setattr("swarm.perf.report.arch_of", lambda model: Arch.from_config(SMALL))
    args = argparse.Namespace(
        model="small",
        spans=["0:1", "1:3"],
        device="rtx3080",
        client_device="cpu",
        dtype="bfloat16",
        delay_ms=20.0,
        mbps=100.0,
        prompt=64,
    )
    text = predict_report(args, None)
    assert "2 x NVIDIA GeForce RTX 3080" in text and "software costs are left out" in text
    assert "decode, chained" in text and "LoRA" in text
    with pytest.raises(SystemExit, match="unknown device"):
        predict_report(argparse.Namespace(**{**vars(args), "device": "tpu9"}), None)
