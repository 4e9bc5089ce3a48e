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

from swarm.errors import BadInputError, run_command
from swarm.logs import configure_logging
from swarm.training.run import RunConfig, load_run


def _latest(folder: Path) -> Path:
    found = sorted(folder.glob("step-*.pt")) if folder.is_dir() else []
    if not found:
        raise BadInputError(f"no checkpoint in {folder}")
    return found[-1]


def stage_from_checkpoint(run: RunConfig, stage, folder: Path | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    data = torch.load(_latest(folder or run.checkpoint_dir / f"stage-{stage.start}-{stage.end}"), weights_only=True)
    params = {k.removeprefix("param."): v for k, v in data["tensors"].items() if k.startswith("param.")}
    return int(data["meta"]["step"]), params


def stages_from_swarm(run: RunConfig, initial_peers: tuple[str, ...]) -> dict[str, tuple[int, dict]]:
    """Each stage's weights from one live peer serving exactly that stage (the one with the highest step)."""
    from swarm.client.loop import LoopThread
    from swarm.client.remote import Remote
    from swarm.dht import read_view, start_dht
    from swarm.training.state import freshest_state, stage_servers

    dht, _ = start_dht(initial_peers=initial_peers, client_mode=True)
    loop = LoopThread()
    remote = None
    try:
        remote = Remote(loop.run(dht.replicate_p2p()))
        view = read_view(dht, run.model_id, run.stages[-1].end)
        out = {}
        for stage in run.stages:
            found = loop.run(freshest_state(remote, stage_servers(view, stage), stage, 60.0))
            if found is None:
                raise BadInputError(f"no live peer serves stage {stage} of run {run.name}")
            step, tensors = found
            out[str(stage)] = (
                step,
                {k.removeprefix("param."): v for k, v in tensors.items() if k.startswith("param.")},
            )
        return out
    finally:
        with contextlib.suppress(Exception):
            loop.run(remote.p2p.shutdown(), 5)
        loop.close()
        dht.shutdown()


def export(run: RunConfig, out: Path, initial_peers: tuple[str, ...] = (), trainer_dir: Path | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    trainer = torch.load(_latest(trainer_dir or run.checkpoint_dir / "trainer"), weights_only=True)
    state = dict(trainer["model"])
    if initial_peers:
        stages = stages_from_swarm(run, initial_peers)
    else:
        stages = {str(s): stage_from_checkpoint(run, s) for s in run.stages}
    for _step, params in stages.values():
        state.update(params)
    config = run.hf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing = sorted(set(model.state_dict()) - set(state))
    if getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise BadInputError(f"the run's checkpoints lack {missing[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(out)
    steps = {name: step for name, (step, _) in stages.items()}
    print(f"exported {run.name}: trainer at step {trainer['step']}, stages at steps {steps} -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.export", description=__doc__)
    p.add_argument("run", help="the run's TOML file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="read stages from live peers")
    p.add_argument("--trainer-checkpoint-dir", type=Path, default=None)
    args = p.parse_args(argv)
    configure_logging("WARNING")
    return run_command(
        lambda: export(load_run(args.run), args.out, tuple(args.initial_peers), args.trainer_checkpoint_dir)
    )


if __name__ == "__main__":
    sys.exit(main())
