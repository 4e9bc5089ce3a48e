"""A pre-training run, as its TOML file describes it (see ``configs/runs/``): model, data, optimizer and schedule,
batch sizes, averaging and checkpoint periods, pipeline stages. Read once by every party and passed explicitly."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from swarm.config import default_cache_dir
from swarm.errors import BadInputError
from swarm.ids import Span, parse_span


@dataclass(frozen=True)
class RunConfig:
    name: str
    seed: int
    model: dict[str, Any]  # Hugging Face config fields (with model_type), or {"from": card name}
    tokenizer: str
    seq_len: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    schedule: str
    warmup_steps: int
    total_steps: int
    target_batch_size: int
    micro_batch_size: int
    pipeline_depth: int  # micro-batches a trainer keeps in flight at once, so stages compute in parallel
    average_every: int
    matchmaking_seconds: float
    checkpoint_every: int
    checkpoint_dir: Path
    stages: tuple[Span, ...]

    @property
    def model_id(self) -> str:
        """The DHT namespace of the run's servers (a run is a model of its own, with changing weights)."""
        return f"run-{self.name}"

    @property
    def trainers_key(self) -> str:
        """DHT key where every trainer keeps {step, samples, updated} in its own signed subkey."""
        return f"swarm/{self.model_id}/trainers"

    @property
    def fingerprint(self) -> str:
        return f"trainable:{self.name}"

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at global step ``step`` (linear warm-up, then constant or cosine to zero)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def hf_config(self):
        """The model's Hugging Face config (from the run's fields, or from the card it continues from)."""
        if "from" in self.model:
            from swarm.config import load_model_card
            from swarm.model_files import load_config, model_folder

            return load_config(model_folder(load_model_card(self.model["from"]), default_cache_dir()))
        from transformers import AutoConfig

        fields = dict(self.model)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def stage_of(self, span: Span) -> Span:
        if span not in self.stages:
            stages = ", ".join(str(s) for s in self.stages)
            raise BadInputError(f"run {self.name!r} trains the stages {stages}; {span} is not one of them")
        return span


def _get(data: dict, section: str, key: str, default=None, kind=None):
    value = data.get(section, {}).get(key, default)
    if value is None:
        raise BadInputError(f"run config: [{section}] {key} is required")
    return kind(value) if kind else value


def load_run(path: str | Path) -> RunConfig:
    """A run TOML file, or the name of one shipped in ``configs/runs``."""
    path = Path(path).expanduser()
    if not path.is_file():
        shipped = resources.files("swarm_configs") / "runs" / f"{path.name.removesuffix('.toml')}.toml"
        if not shipped.is_file():
            raise BadInputError(f"no run config at {path}")
        text = shipped.read_text()
    else:
        text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInputError(f"run config {path}: {e}") from None
    name = data.get("name")
    if not name or not str(name).replace("-", "").replace("_", "").isalnum():
        raise BadInputError("run config: name must be letters, digits, '-' or '_'")
    model = dict(data.get("model", {}))
    if "from" not in model and "model_type" not in model:
        raise BadInputError("run config: [model] needs model_type (from scratch) or from (a model card)")
    ckpt = data.get("checkpoint", {}).get("dir") or ""
    run = RunConfig(
        name=name,
        seed=int(data.get("seed", 0)),
        model=model,
        tokenizer=_get(data, "data", "tokenizer", "bytes", str),
        seq_len=_get(data, "data", "seq_len", None, int),
        lr=_get(data, "optimizer", "lr", None, float),
        betas=tuple(float(b) for b in _get(data, "optimizer", "betas", [0.9, 0.999])),
        eps=_get(data, "optimizer", "eps", 1e-8, float),
        weight_decay=_get(data, "optimizer", "weight_decay", 0.0, float),
        schedule=_get(data, "schedule", "kind", "constant", str),
        warmup_steps=_get(data, "schedule", "warmup_steps", 0, int),
        total_steps=_get(data, "schedule", "total_steps", 1000, int),
        target_batch_size=_get(data, "batch", "target_batch_size", None, int),
        micro_batch_size=_get(data, "batch", "micro_batch_size", None, int),
        pipeline_depth=_get(data, "batch", "pipeline_depth", 2, int),
        average_every=_get(data, "averaging", "every_steps", 10, int),
        matchmaking_seconds=_get(data, "averaging", "matchmaking_seconds", 2.0, float),
        checkpoint_every=_get(data, "checkpoint", "every_steps", 10, int),
        checkpoint_dir=Path(ckpt).expanduser() if ckpt else default_cache_dir() / "runs" / name,
        stages=tuple(parse_span(s) for s in _get(data, "stages", "spans", None)),
    )
    if run.schedule not in ("constant", "cosine"):
        raise BadInputError(f"run config: schedule kind must be constant or cosine, got {run.schedule!r}")
    if run.pipeline_depth < 1:
        raise BadInputError("run config: pipeline_depth must be at least 1")
    if run.target_batch_size % run.micro_batch_size:
        raise BadInputError("run config: target_batch_size must be a multiple of micro_batch_size")
    ends = [s.end for s in run.stages]
    if [s.start for s in run.stages] != [0, *ends[:-1]]:
        raise BadInputError("run config: stages must cover the blocks from 0, in order, without gaps or overlaps")
    return run


def with_overrides(run: RunConfig, **fields) -> RunConfig:
    """A copy with some fields replaced (tests and benchmarks: checkpoint dir, periods)."""
    from dataclasses import replace

    return replace(run, **fields)
