"""``python -m swarm.export RUN.toml --out DIR``: assemble a full Hugging Face checkpoint of a pre-training run.

The embeddings, final norm and head come from the trainer's latest checkpoint; each stage's blocks come from a live
peer serving it (``--initial-peers``, the freshest weights) or, without that, from the stages' latest checkpoints
under the run's checkpoint directory. The result loads with ``AutoModelForCausalLM.from_pretrained(DIR)``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from swarm.config import Timing
from swarm.errors import BadInputError, run_command
from swarm.hf_calls import output_embeddings
from swarm.ids import Span
from swarm.logs import configure_logging
from swarm.training import checkpoints
from swarm.training.checkpoints import StageCheckpoint, TrainerCheckpoint
from swarm.training.run import RunConfig, load_run

Weights = dict[str, torch.Tensor]


def _params(tensors: Weights) -> Weights:
    return {k.removeprefix("param."): v for k, v in tensors.items() if k.startswith("param.")}


def stage_from_checkpoint(run: RunConfig, stage: Span, folder: Path | None = None) -> tuple[int, Weights]:
    folder = folder or run.checkpoint_dir / f"stage-{stage.start}-{stage.end}"
    checkpoint = checkpoints.load_latest(folder, StageCheckpoint)
    if checkpoint is None:
        raise BadInputError(f"no checkpoint in {folder}")
    return checkpoint.step, _params(checkpoint.tensors)


def stages_from_swarm(
    run: RunConfig, initial_peers: tuple[str, ...], timing: Timing, swarm_key: Path | None = None
) -> dict[str, tuple[int, Weights]]:
    """Each stage's weights from the live peers serving exactly that stage: the state of the last averaging round
    two replicas vouch for, else the furthest replica's within what the trainers signed (``swarm.training.state``)."""
    from swarm.dht import start_dht
    from swarm.membership import swarm_key_for
    from swarm.rpc.loop import LoopThread
    from swarm.rpc.remote import Remote
    from swarm.training.init import stage_state_bytes
    from swarm.training.state import stage_sources, stage_state

    store = start_dht(
        initial_peers=initial_peers,
        client_mode=True,
        timeout=timing.dht_start_timeout,
        call_timeout=timing.dht_timeout,
        swarm_key=swarm_key_for(swarm_key),
    )
    loop = LoopThread("swarm-export")
    remote: Remote | None = None
    try:
        remote = Remote(loop.run(store.replicate_p2p()), store.credentials())
        out = {}
        for stage in run.stages:
            limit = stage_state_bytes(run, stage)
            sources = stage_sources(store, run, stage, timing)
            found = loop.run(stage_state(remote, sources, stage, timing.state_timeout, limit))
            if found is None:
                raise BadInputError(f"no live peer serves stage {stage} of run {run.name}")
            out[str(stage)] = (found[0], _params(found[1]))
        return out
    finally:
        if remote is not None:
            with contextlib.suppress(Exception):
                loop.run(remote.p2p.shutdown(), timing.shutdown_timeout)
        loop.close(timing.shutdown_timeout)
        store.shutdown()


def export(
    run: RunConfig,
    out: Path,
    initial_peers: tuple[str, ...] = (),
    trainer_dir: Path | None = None,
    timing: Timing | None = None,
    swarm_key: Path | None = None,
) -> Path:
    from swarm.model_files import new_model
    from swarm.training.init import hf_names

    folder = trainer_dir or run.checkpoint_dir / "trainer"
    trainer = checkpoints.load_latest(folder, TrainerCheckpoint)
    if trainer is None:
        raise BadInputError(f"no trainer checkpoint in {folder}")
    config = run.hf_config()
    theirs = hf_names(config)  # the trainer's tensors by the client's names -> the family's checkpoint names
    state = {theirs.get(name, name): t for name, t in trainer.model.items()}
    if initial_peers:
        stages = stages_from_swarm(run, initial_peers, timing or Timing(), swarm_key)
    else:
        stages = {str(s): stage_from_checkpoint(run, s) for s in run.stages}
    for _step, params in stages.values():
        state.update(params)
    with torch.device("meta"):
        model = new_model(config)
    missing = sorted(set(model.state_dict()) - set(state))
    if getattr(config, "tie_word_embeddings", False):
        head = output_embeddings(model)
        tied = {f"{n}.weight" for n, m in model.named_modules() if m is head}
        missing = [k for k in missing if k not in tied]
    if missing:
        raise BadInputError(f"the run's checkpoints lack {missing[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(out)
    steps = {name: step for name, (step, _) in stages.items()}
    print(f"exported {run.name}: trainer at step {trainer.step}, stages at steps {steps} -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.export", description=__doc__)
    p.add_argument("run", help="the run's TOML file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="read stages from live peers")
    p.add_argument("--trainer-checkpoint-dir", type=Path, default=None)
    p.add_argument("--cache-dir", type=Path, default=None, help="converted models (default ~/.cache/swarm)")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    args = p.parse_args(argv)
    configure_logging("WARNING")
    return run_command(
        lambda: export(
            load_run(args.run, args.cache_dir),
            args.out,
            tuple(args.initial_peers),
            args.trainer_checkpoint_dir,
            swarm_key=args.swarm_key,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
