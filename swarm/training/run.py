"""A pre-training run, as its TOML file describes it (see ``configs/runs/``): model, data, optimizer and schedule,
batch sizes, averaging and checkpoint periods, pipeline stages. Read once by every party and passed explicitly."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.config import default_cache_dir
from swarm.errors import BadInputError
from swarm.ids import Span, parse_span

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Sync:
    """How replicas of a stage (and trainers) keep together. ``parameters``: average weights and Adam's moments
    every ``average_every`` steps (local SGD). ``diloco``: take ``average_every`` inner steps alone, then average the
    round's pseudo-gradients (start minus end), sent as ``compression`` says (``topk``: the largest ``density`` of
    them, the rest carried to the next round), and step an outer Nesterov SGD (``outer_lr``, ``outer_momentum``)
    from the round's start (``swarm/training/diloco.py``)."""

    method: Literal["parameters", "diloco"] = "parameters"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    compression: Literal["none", "int8", "topk"] = "none"
    density: float = 0.01


@dataclass(frozen=True)
class RunConfig:
    name: str
    seed: int
    model: dict[str, object]  # Hugging Face config fields (with model_type), or {"from": card name}
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
    averaging_request_timeout: float  # one message of an averaging round
    averaging_timeout: float  # a whole round, matchmaking included
    averaging_group: int  # most replicas averaged in one group (hivemind's butterfly all-reduce)
    checkpoint_every: int
    checkpoint_dir: Path
    stages: tuple[Span, ...]
    cache_dir: Path  # where the model a run continues from is converted (see ``source_folder``)
    trainers: tuple[str, ...] = ()  # peer ids that may train (a closed run); empty: anyone may (an open run)
    max_grad_norm: float = 1000.0  # per sample: a larger contribution to a stage's gradient is scaled down to it
    sync: Sync = Sync()

    def is_trainer(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may feed the run (whose progress and step notices count)."""
        return not self.trainers or peer_id in self.trainers

    @property
    def catch_up_limit(self) -> int:
        """Most steps a stage may take at once to follow the swarm: a stage that restarts from its last checkpoint,
        or joins with the state of the last averaging round, is at most a period behind (the trainers cannot step
        while no peer serves a stage). A claim beyond it is a lie, and would spin the stage through empty steps."""
        return max(self.checkpoint_every, self.average_every, 1) + 1

    @property
    def model_id(self) -> str:
        """The DHT namespace of the run's servers (a run is a model of its own, with changing weights)."""
        return f"run-{self.name}"

    @property
    def trainers_key(self) -> str:
        """DHT key where every trainer keeps {step, samples, updated} in its own signed subkey."""
        return f"swarm/{self.model_id}/trainers"

    def rounds_key(self, stage: Span) -> str:
        """DHT key where each replica of ``stage`` signs the state of its last averaging round (``RoundRecord``)."""
        return f"swarm/{self.model_id}/rounds/{stage.start}-{stage.end}"

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

    def source_folder(self) -> Path | None:
        """The Hugging Face folder of the model the run continues from (``from = card``), None from scratch: the
        one lookup every party uses."""
        if "from" not in self.model:
            return None
        from swarm.config import load_model_card
        from swarm.model_files import model_folder

        return model_folder(load_model_card(str(self.model["from"])), self.cache_dir)

    def hf_config(self) -> PretrainedConfig:
        """The model's Hugging Face config (from the run's fields, or from the card it continues from), with the
        attention its family runs (``swarm.families``), once a training step of its twin through the swarm's split
        equals one process's (``swarm.training.proof``); BadInputError naming what differed otherwise."""
        from transformers import AutoConfig

        folder = self.source_folder()
        if folder is not None:
            from swarm.model_files import load_config

            config = load_config(folder)
        else:
            fields = dict(self.model)
            config = AutoConfig.for_model(str(fields.pop("model_type")), **fields)
        from swarm.families.spec import family_of
        from swarm.training.proof import require_trainable

        family = family_of(config)
        try:
            require_trainable(config)
        except BadInputError as e:
            raise BadInputError(f"run {self.name!r} ({family.spec.label}): {e}") from None
        return family.config

    def stage_of(self, span: Span) -> Span:
        if span not in self.stages:
            stages = ", ".join(str(s) for s in self.stages)
            raise BadInputError(f"run {self.name!r} trains the stages {stages}; {span} is not one of them")
        return span


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Data(_Section):
    tokenizer: str = "bytes"
    seq_len: int = Field(gt=0)


class _Optimizer(_Section):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class _Schedule(_Section):
    kind: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(1000, gt=0)


class _Batch(_Section):
    target_batch_size: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    pipeline_depth: int = Field(2, ge=1)


class _Averaging(_Section):
    every_steps: int = Field(10, ge=0)
    matchmaking_seconds: float = Field(2.0, gt=0)
    request_timeout: float | None = Field(None, gt=0)  # default: 1 s, or 0.9 of a shorter matchmaking period
    round_timeout: float | None = Field(None, gt=0)  # default: five matchmaking periods
    group_size: int = Field(8, ge=2)
    method: Literal["parameters", "diloco"] = "parameters"
    # measured best on short runs (docs/pretraining.md); DiLoCo's paper uses 0.7 and 0.9 with H in the hundreds
    outer_lr: float = Field(1.0, gt=0, le=10)
    outer_momentum: float = Field(0.0, ge=0, lt=1)
    compression: Literal["none", "int8", "topk"] = "none"
    density: float = Field(0.01, gt=0, le=1)  # with topk: the share of pseudo-gradient values a round sends


class _Checkpoint(_Section):
    every_steps: int = Field(10, ge=0)
    dir: str = ""  # default: <cache dir>/runs/<name>


class _Trust(_Section):
    trainers: list[str] = Field(default_factory=list, max_length=4096)
    max_grad_norm: float = Field(1000.0, gt=0, allow_inf_nan=False)


class _Stages(_Section):
    spans: list[str] = Field(min_length=1)


class _RunFile(_Section):
    """A run's TOML, validated section by section."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    seed: int = 0
    model: dict[str, object]
    data: _Data
    optimizer: _Optimizer
    schedule: _Schedule = _Schedule()
    batch: _Batch
    averaging: _Averaging = _Averaging()
    checkpoint: _Checkpoint = _Checkpoint()
    trust: _Trust = _Trust()
    stages: _Stages


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}" for err in e.errors())


def load_run(path: str | Path, cache_dir: Path | None = None) -> RunConfig:
    """A run TOML file, or the name of one shipped in ``configs/runs``; ``cache_dir`` (default: ``SWARM_CACHE_DIR``
    or ~/.cache/swarm) holds converted models and the default checkpoint directory."""
    cache_dir = cache_dir or default_cache_dir()
    path = Path(path).expanduser()
    if not path.is_file():
        shipped = resources.files("swarm_configs") / "runs" / f"{path.name.removesuffix('.toml')}.toml"
        if not shipped.is_file():
            raise BadInputError(f"no run config at {path}")
        text = shipped.read_text()
    else:
        text = path.read_text()
    try:
        f = _RunFile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise BadInputError(f"run config {path}: {e}") from None
    except ValidationError as e:
        raise BadInputError(f"run config {path}: {_problems(e)}") from None
    if "from" not in f.model and "model_type" not in f.model:
        raise BadInputError("run config: [model] needs model_type (from scratch) or from (a model card)")
    avg, ckpt = f.averaging, f.checkpoint.dir
    run = RunConfig(
        name=f.name,
        seed=f.seed,
        model=dict(f.model),
        tokenizer=f.data.tokenizer,
        seq_len=f.data.seq_len,
        lr=f.optimizer.lr,
        betas=f.optimizer.betas,
        eps=f.optimizer.eps,
        weight_decay=f.optimizer.weight_decay,
        schedule=f.schedule.kind,
        warmup_steps=f.schedule.warmup_steps,
        total_steps=f.schedule.total_steps,
        target_batch_size=f.batch.target_batch_size,
        micro_batch_size=f.batch.micro_batch_size,
        pipeline_depth=f.batch.pipeline_depth,
        average_every=avg.every_steps,
        matchmaking_seconds=avg.matchmaking_seconds,
        averaging_request_timeout=avg.request_timeout or min(1.0, 0.9 * avg.matchmaking_seconds),
        averaging_timeout=avg.round_timeout or avg.matchmaking_seconds * 5,
        averaging_group=avg.group_size,
        checkpoint_every=f.checkpoint.every_steps,
        checkpoint_dir=Path(ckpt).expanduser() if ckpt else cache_dir / "runs" / f.name,
        stages=tuple(parse_span(s) for s in f.stages.spans),
        cache_dir=cache_dir,
        trainers=tuple(f.trust.trainers),
        max_grad_norm=f.trust.max_grad_norm,
        sync=Sync(avg.method, avg.outer_lr, avg.outer_momentum, avg.compression, avg.density),
    )
    if run.averaging_request_timeout >= run.matchmaking_seconds:  # hivemind: "to avoid potential deadlocks"
        raise BadInputError(
            f"run config: averaging.request_timeout ({run.averaging_request_timeout:g} s) must be shorter than "
            f"averaging.matchmaking_seconds ({run.matchmaking_seconds:g} s), or matchmaking can deadlock"
        )
    if run.sync.compression != "none" and run.sync.method != "diloco":
        raise BadInputError('run config: averaging.compression needs method = "diloco" (weights are sent whole)')
    if run.target_batch_size % run.micro_batch_size:
        raise BadInputError("run config: target_batch_size must be a multiple of micro_batch_size")
    ends = [s.end for s in run.stages]
    if [s.start for s in run.stages] != [0, *ends[:-1]]:
        raise BadInputError("run config: stages must cover the blocks from 0, in order, without gaps or overlaps")
    return run
