"""The swarm's own fixed costs, measured with real peers on this machine serving a model too small for its compute
to matter (3 layers of hidden size 64, vocabulary 256): what a hop, a call, a session step and a training step cost
beyond the work of the blocks. An entry point (it runs the client): ``python -m harness.perf calibrate``.

Each cost is a difference between two configurations that differ in that one thing (one server against three, the
same client), so the client's and the model's own costs cancel; what the micro model still computes is taken off
with the hardware's calibrated block costs."""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from harness.perf.calibrate import MICRO
from swarm.perf.arch import Arch, context_of
from swarm.perf.calibration import Hardware
from swarm.perf.model import Device

MIB = 1024 * 1024
LAYERS = 3  # the micro model's; served by one peer, then by one peer per layer
SPANS = (["0:3"], ["0:1", "1:2", "2:3"])
CARD = """name = "perf-micro-{digest}"
description = "the performance model's calibration model: 3 layers, hidden 64, seeded random weights"
[source]
kind = "random"
seed = 0
dtype = "float32"
[source.config]
{config}
"""
RUN = """name = "perf-micro-run"
seed = 0
[model]
{config}
[data]
tokenizer = "bytes"
seq_len = 16
[optimizer]
lr = 1e-3
[schedule]
kind = "constant"
[batch]
target_batch_size = 2
micro_batch_size = 2
pipeline_depth = 1
[averaging]
every_steps = 0
[checkpoint]
every_steps = 0
dir = "{dir}"
[stages]
spans = {spans}
"""


def _toml(config: dict[str, object]) -> str:
    def value(v: object) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)

    return "\n".join(f"{k} = {value(v)}" for k, v in config.items())


def _timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_software(hw: Hardware, repeats: int = 7) -> tuple[dict[str, float], float]:
    """(``Software`` fields, transport bytes/s)."""
    from transformers import AutoModelForCausalLM

    from swarm import DistributedModelForCausalLM
    from swarm.config import default_cache_dir, load_model_card
    from swarm.launch import LocalSwarm
    from swarm.model_files import model_folder

    config = dict(MICRO, num_hidden_layers=LAYERS)
    arch = Arch.from_config(config)
    dev = Device(
        "calibrated",
        hw.flops,
        hw.bandwidth,
        4.0,
        hw.block_overhead,
        hw.backward_overhead,
        attention_flops=hw.attention_flops,
        elementwise_bandwidth=hw.elementwise_bandwidth,
        stream_curve=hw.stream_curve,
    )
    new, seq = 24, 64  # the middle of the 8- and 40-token generations

    def blocks(n: int, tokens: int, past: int) -> float:
        return n * dev.block(arch, tokens, context_of(past, tokens)).total

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-perf-") as tmp:
        # the card's name carries its config's digest: a generated model is cached by name
        digest = hashlib.sha256(_toml(config).encode()).hexdigest()[:10]
        card = Path(tmp) / f"perf-micro-{digest}.toml"
        card.write_text(CARD.format(config=_toml(config), digest=digest))
        local = AutoModelForCausalLM.from_pretrained(model_folder(load_model_card(str(card)), default_cache_dir()))
        torch.manual_seed(0)
        prompt, long = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, seq))
        step_compute = blocks(LAYERS, 1, 16 + new // 2)
        step, opened = _generation(local, prompt, repeats)
        out["local_step"], out["local_open"] = step - step_compute, opened
        with torch.no_grad():
            out["local_call"] = _timed(lambda: local(long), repeats) - blocks(LAYERS, seq, 0)
        steps: dict[tuple[int, bool], tuple[float, float]] = {}
        call: dict[int, float] = {}
        train: dict[int, float] = {}
        bandwidth = 0.0
        for spans in SPANS:
            n = len(spans)
            with LocalSwarm(str(card), list[str | None](spans), extra_args=("--throughput", "100")) as swarm:
                for chain in (True, False):
                    with DistributedModelForCausalLM.from_pretrained(
                        str(card), initial_peers=swarm.initial_peers, chain=chain, codec="none"
                    ) as remote:
                        steps[n, chain] = _generation(remote, prompt, repeats)
                        if not chain:
                            continue
                        with torch.no_grad():
                            call[n] = _timed(lambda: remote(long), repeats)

                        def fb() -> None:
                            remote.zero_grad(set_to_none=True)
                            remote(long, labels=long).loss.backward()

                        train[n] = _timed(fb, repeats) - call[n]
                        if n == 1:
                            bandwidth = _transport_bandwidth(remote)
        train_steps = _pretrain_steps(Path(tmp), config, repeats)
    k = LAYERS - 1  # hops more in the second configuration
    for chain, suffix in ((False, ""), (True, "_chained")):
        (one, open1), (many, open_many) = steps[1, chain], steps[LAYERS, chain]
        out[f"step_hop{suffix}"] = (many - one) / k
        out[f"client_step{suffix}"] = one - out[f"step_hop{suffix}"] - step_compute
        out[f"open_hop{suffix}"] = (open_many - open1) / k
        out[f"client_open{suffix}"] = open1 - out[f"open_hop{suffix}"]
    out["call_hop"] = (call[LAYERS] - call[1]) / k
    out["client_call"] = call[1] - out["call_hop"] - blocks(LAYERS, seq, 0)
    backward = LAYERS * dev.block_backward(arch, seq, context_of(0, seq), False).total
    out["backward_hop"] = (train[LAYERS] - train[1]) / k
    out["client_backward"] = train[1] - out["backward_hop"] - backward
    # pre-training, one micro-batch per step: each further stage adds a forward and a backward call
    out["stage_call"] = (train_steps[LAYERS] - train_steps[1]) / (2 * k)
    compute = LAYERS * (
        dev.block(arch, 2 * 16, context_of(0, 16)).total
        + dev.block_backward(arch, 2 * 16, context_of(0, 16), True).total
    )
    out["train_step"] = train_steps[1] - 2 * out["stage_call"] - compute
    return out, bandwidth


def _generation(model: object, prompt: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(seconds per generated token, fixed seconds per ``generate`` call): the slope between generations of 8 and
    of 40 tokens, and what a generation of one token (the session's opening and the prompt's step) costs beyond
    one step."""

    def run(n: int) -> float:
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return _timed(lambda: model.generate(prompt, **gen), repeats)  # type: ignore[attr-defined]

    per_token = (run(40) - run(8)) / 32
    return per_token, run(1) - per_token


def _transport_bandwidth(remote: object) -> float:
    """Bytes/s of the client's transport to a server on this machine: a 16 MiB probe against a 64 KiB one."""
    from swarm.hop import Hop

    conn = remote.connection  # type: ignore[attr-defined]
    hop = Hop.of(next(iter(conn.view.servers())))
    run = conn.loop.run

    def send(nbytes: int) -> float:
        return float(statistics.median(run(conn.remote.send_payload(hop, nbytes, 60.0), 120.0) for _ in range(5)))

    small, big = send(64 * 1024), send(16 * MIB)
    return float((16 * MIB - 64 * 1024) / max(big - small, 1e-6))


def _pretrain_steps(tmp: Path, config: dict[str, object], repeats: int) -> dict[int, float]:
    """Median seconds of a pre-training step (one micro-batch of 2 x 16 bytes) through 1 and through 3 stages."""
    from swarm.client.training.trainer import Trainer
    from swarm.config import Timing
    from swarm.launch import LocalSwarm
    from swarm.training.data import Samples, corpus_files, tokenize
    from swarm.training.run import load_run

    out = {}
    for spans in SPANS:
        path = tmp / f"run-{len(spans)}.toml"
        model = dict(config)
        model.pop("max_position_embeddings")
        model["max_position_embeddings"] = 64
        path.write_text(RUN.format(config=_toml(model), dir=tmp / "ckpt", spans=str(spans).replace("'", '"')))
        run = load_run(path)
        data = Samples(tokenize(corpus_files(None), run.tokenizer, 256), run.seq_len, run.seed)
        with LocalSwarm(
            "tiny-llama", list[str | None](spans), extra_args=("--throughput", "100", "--train", str(path))
        ) as swarm:
            with Trainer(run, data, tuple(swarm.initial_peers), timing=Timing()) as trainer:
                out[len(spans)] = _timed(trainer.train_step, repeats * 2)
    return out
