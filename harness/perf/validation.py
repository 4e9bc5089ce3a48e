"""Predictions for the runs of the benchmarks (``scripts/validate_model.py``): each benchmark's JSON in, one row per
measured number out, with the prediction and its breakdown. Pure, apart from reading the models' configs.

Rows fall in two regimes that the summary keeps apart: **compute-bound** (one process, or peers on loopback: the
machine's cores, memory and the software's fixed costs decide) and **delay-bound** (behind emulated links: the
links' delays and bandwidth decide, which the model knows exactly from the emulator's settings). And in two samples:
**in-sample**, the runs the model's structure was developed on, and **out-of-sample** (held out: a model shape and a
span count it was never developed on), priced by the same code with nothing changed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swarm.perf.arch import Arch
from swarm.perf.calibration import Calibration
from swarm.perf.model import Cost, Link
from swarm.perf.predict import (
    Swarm,
    decode_step,
    forward_time,
    generate_time,
    pretrain_step,
    train_time,
    ttft,
    uniform,
)
from swarm.perf.report import arch_of, lora_params, spans_of

TOLERANCE = 0.25
WAN_LINKS = {"a": (20.0, 100.0), "b": (50.0, 100.0), "c": (50.0, 20.0)}  # as scripts/bench_wan.py
GOODPUT = 0.96  # of a link's rate left for payload after TCP/IP headers (1448 of 1500-byte frames, plus ACKs)


@dataclass(frozen=True)
class Row:
    bench: str
    case: str
    unit: str
    measured: float
    predicted: float
    cost: Cost
    rate: bool  # the unit is per second (predicted from 1 / time)
    regime: str = "compute"  # "compute": one process or loopback; "delay": behind an emulated link
    sample: str = "in"  # "in": a run the model's structure was developed on; "out": held out

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "case": self.case,
            "unit": self.unit,
            "measured": self.measured,
            "predicted": self.predicted,
            "error": self.error,
            "breakdown": self.cost.as_dict(),
            "regime": self.regime,
            "sample": self.sample,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        b = {k: v for k, v in d["breakdown"].items() if k != "total"}
        rate = d["unit"] != "s"
        return cls(
            d["bench"], d["case"], d["unit"], d["measured"], d["predicted"], Cost(**b), rate, d["regime"], d["sample"]
        )


def _row(bench: str, case: str, unit: str, measured: float, cost: Cost, per: float = 0.0) -> Row:
    """``per``: the measured number is ``per`` units per second (the prediction is ``per / time``); else seconds."""
    predicted = per / cost.total if per else cost.total
    return Row(bench, case, unit, measured, predicted, cost, bool(per))


def swarms(
    cal: Calibration, arch: Arch, spans: list[str], cores: float, link: Link | None = None
) -> tuple[Swarm, Swarm]:
    """The one-process reference and the swarm, every party sharing the ``cores`` the run measured."""
    dev, sw = cal.device(), cal.costs()
    link = link or cal.link()
    local = Swarm(arch, dev, software=sw, cores=cores)
    return local, uniform(arch, spans_of(spans), dev, dev, link, sw, cores=cores)


def inference_rows(cal: Calibration, data: dict[str, Any], cores: float) -> list[Row]:
    rows = []
    new, seq = int(data["args"]["new_tokens"]), int(data["args"]["seq"])
    for model, results in data["results"].items():
        arch = arch_of(model)
        local, remote = swarms(cal, arch, data["spans"][model], cores)
        client_params = arch.vocab * arch.hidden * (1 if arch.tied else 2) + arch.hidden
        for name, m_local, m_swarm in results:
            for side, m, sw in (("local", m_local, local), ("swarm", m_swarm, remote)):
                label = name.rsplit(" ", 1)[0]  # without its unit: "decode", "forward [1, 512]"...
                case = f"{model} {len(remote.servers)} peers, {label} ({side})"
                if name.startswith("decode"):
                    rows.append(_row("bench_inference", case, "tokens/s", m, generate_time(sw, 16, new), per=new))
                elif name.startswith("forward+backward"):
                    cost = train_time(sw, 1, seq, client_params=client_params, update=False)
                    rows.append(_row("bench_inference", case, "s", m, cost))
                elif name.startswith("forward"):
                    rows.append(_row("bench_inference", case, "s", m, forward_time(sw, 1, seq)))
    return rows


def finetune_rows(cal: Calibration, data: dict[str, Any], cores: float) -> list[Row]:
    a = data["args"]
    arch = arch_of(a["model"])
    local, remote = swarms(cal, arch, a["spans"], cores)
    n = int(data["adapter_params"])
    rows = []
    for side, m, sw in (("local PEFT", data["local_step_s"], local), ("swarm", data["swarm_step_s"], remote)):
        cost = train_time(sw, int(a["batch"]), int(a["seq"]), adapter_params=n)
        case = f"{a['model']} LoRA r={a['rank']}, {len(a['spans'])} peers, batch {a['batch']}x{a['seq']} ({side})"
        rows.append(_row("bench_finetune", case, "steps/s", 1.0 / float(m), cost, per=1.0))
    return rows


def pretrain_rows(cal: Calibration, data: dict[str, Any], cores: float) -> list[Row]:
    from swarm.training.run import load_run

    run = load_run(Path(data["run"]))
    return _pretrain(cal, run, "bench_pretrain", data["local_step_s"], data["swarm_step_s"], None, cores)


def _pretrain(
    cal: Calibration,
    run: Any,
    bench: str,
    m_local: float | None,
    m_swarm: float,
    link: Link | None,
    cores: float,
) -> list[Row]:
    arch = Arch.from_config(run.hf_config())
    local, remote = swarms(cal, arch, [str(s) for s in run.stages], cores, link)
    tokens = run.target_batch_size * run.seq_len
    rows = []
    for side, m, sw in (("local", m_local, local), ("swarm", m_swarm, remote)):
        if m is None:
            continue
        cost = pretrain_step(sw, run.target_batch_size, run.seq_len, run.micro_batch_size, run.pipeline_depth)
        case = f"{run.name}, {len(run.stages)} stages, batch {run.target_batch_size}x{run.seq_len} ({side})"
        rows.append(_row(bench, case, "tokens/s", tokens / float(m), cost, per=tokens))
    return rows


def wan_link(cal: Calibration, link: str, codec: str) -> Link:
    """The emulated link as the model sees it: one-way delay, the slower of the link's goodput and the transport's
    own rate per byte, and the codec."""
    if link in ("loopback", "z"):
        return cal.link(codec=codec)
    delay, mbit = WAN_LINKS[link]
    return cal.link(delay / 1e3, mbit * 1e6 / 8 * GOODPUT, codec)


WAN_SPANS = {"smollm2-135m": ["0:10", "10:20", "20:30"], "tiny-llama": ["0:2", "2:4", "4:6", "6:8"]}  # older runs


def wan_rows(cal: Calibration, data: dict[str, Any], cores: float) -> list[Row]:
    spans: dict[str, list[str]] = data.get("spans", WAN_SPANS)
    rows = []
    for model, local_item in data["local"].items():
        arch = arch_of(model)
        local, _ = swarms(cal, arch, spans[model], cores)
        rows.append(_row("bench_wan", f"{model} local decode step", "s", local_item["step_s"], decode_step(local, 24)))
        rows.append(
            _row("bench_wan", f"{model} local time to first token", "s", local_item["ttft_s"], ttft(local, 512))
        )
    for r in data["results"]:
        if r.get("plane") != "direct" or r["task"] == "local":
            continue
        model, mode = r["model"], r.get("mode", "")
        chained = "chain=on" in mode
        codec = mode.split("codec=")[1] if "codec=" in mode else "none"
        link = wan_link(cal, r["link"], codec)
        arch = arch_of(model)
        _, remote = swarms(cal, arch, spans[model], cores, link)
        regime = "compute" if r["link"] in ("loopback", "z") else "delay"
        before = len(rows)
        where = f"{model} {len(remote.servers)} peers, link {r['link']}, {mode}"
        if r["task"] == "decode":
            rows.append(_row("bench_wan", f"{where}: decode step", "s", r["step_s"], decode_step(remote, 24, chained)))
        elif r["task"] == "ttft":
            rows.append(
                _row("bench_wan", f"{where}: time to first token", "s", r["ttft_s"], ttft(remote, 512, chained))
            )
        elif r["task"] == "finetune":
            n = lora_params(arch, 8, ("q_proj", "k_proj", "v_proj", "o_proj"))
            cost = train_time(remote, int(r.get("batch", 2)), int(r.get("seq", 64)), adapter_params=n)
            rows.append(_row("bench_wan", f"{where}: LoRA steps/s", "steps/s", r["steps_per_s"], cost, per=1.0))
        elif r["task"] == "pretrain":
            from swarm.training.run import load_run

            run = load_run(Path(r["pretrain_run"]))
            (row,) = _pretrain(cal, run, "bench_wan", None, r["step_s"], link, cores)
            rows.append(replace(row, case=f"{where}: pre-training"))
        rows[before:] = [replace(row, regime=regime) for row in rows[before:]]
    return rows


PRICERS = {"inference": inference_rows, "finetune": finetune_rows, "pretrain": pretrain_rows, "wan": wan_rows}
HELD_OUT = "heldout-"  # a run's name with this prefix is out-of-sample: priced alike, reported apart


def predict_rows(cal: Calibration, measured: dict[str, Any], cores: float) -> list[Row]:
    """Every run's rows; ``measured``: run name (a benchmark's, or ``heldout-`` and one) -> that run's JSON;
    ``cores``: the processors the run's parties shared, as the run measured them."""
    rows: list[Row] = []
    for name, data in measured.items():
        kind = name.removeprefix(HELD_OUT)
        if kind not in PRICERS:
            continue
        got = PRICERS[kind](cal, data, cores)
        rows += [replace(r, sample="out") for r in got] if name.startswith(HELD_OUT) else got
    return rows


GROUPS = (
    ("in-sample, compute-bound (one process or loopback)", "in", "compute"),
    ("in-sample, delay-bound (behind emulated links)", "in", "delay"),
    ("out-of-sample, compute-bound", "out", "compute"),
    ("out-of-sample, delay-bound", "out", "delay"),
)


def summary(rows: Sequence[Row]) -> list[str]:
    """One line per group of rows (compute-bound first, then delay-bound; in-sample, then held out): how many are
    within the tolerance, the median and the worst absolute error."""
    out = []
    for label, sample, regime in GROUPS:
        group = [r for r in rows if r.sample == sample and r.regime == regime]
        if not group:
            continue
        errors = [abs(r.error) for r in group]
        within = sum(1 for e in errors if e <= TOLERANCE)
        out.append(
            f"{label}: {within} of {len(group)} within {TOLERANCE:.0%}, median |error| "
            f"{statistics.median(errors):.0%}, worst {max(errors):.0%}"
        )
    return out


def table(rows: Sequence[Row]) -> str:
    head = (
        "| benchmark | case | unit | measured | predicted | error | compute | memory | overhead | comm | software "
        "| bubble |"
    )
    out = [head, "|" + " --- |" * 12]
    for r in rows:
        total = r.cost.total or math.inf
        shares = " | ".join(
            f"{getattr(r.cost, k) / total:.0%}" for k in ("compute", "memory", "overhead", "comm", "software", "bubble")
        )
        mark = "" if abs(r.error) <= TOLERANCE else " **miss**"
        out.append(
            f"| {r.bench} | {r.case} | {r.unit} | {r.measured:.4g} | {r.predicted:.4g} | {r.error:+.0%}{mark} "
            f"| {shares} |"
        )
    return "\n".join(out)


def report(rows: Sequence[Row]) -> str:
    """The summary, then one table per group (compute-bound first): what ``docs/cost-model.md`` shows of a run."""
    out = ["\n".join(f"- {line}" for line in summary(rows))]
    for label, sample, regime in GROUPS:
        group = [r for r in rows if r.sample == sample and r.regime == regime]
        if group:
            out.append(f"**{label[0].upper()}{label[1:]}**\n\n{table(group)}")
    return "\n\n".join(out)
