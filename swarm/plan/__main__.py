"""``python -m swarm.plan``: the plan a client would run now, for one procedure over the live swarm, printed as a
table and written as JSON, msgpack, Graphviz DOT or a picture; or ``--check FILE``: a plan file read as a hostile
one (validated, then printed), exit code 2 with the reason if it is refused.

    python -m swarm.plan --initial-peers MADDR --task finetune --tuning lora --png finetune.png
    python -m swarm.plan --check plan.json

The route comes from the swarm as the client's own would: a client-mode DHT peer reads the servers' records, keeps
only servers of the model's own weights (or of a pre-training run's stages, ``--run``) and takes the cheapest
route; the DHT is shut down before the plan is printed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from swarm.config import ClientConfig, Timing, default_cache_dir, load_model_card
from swarm.errors import BadInputError, CacheFullError, MissingBlocksError, run_command
from swarm.hop import Hop
from swarm.logs import add_log_flags, configure_logging
from swarm.plan.compile import (
    Call,
    ModelShape,
    finetune_plan,
    forward_plan,
    generate_plan,
    hidden_plan,
    pretrain_plan,
    score_plan,
)
from swarm.plan.dot import FORMATS, render, to_dot
from swarm.plan.ir import Plan, PlanError, Task
from swarm.plan.table import table

if TYPE_CHECKING:
    from transformers import PretrainedConfig

TASKS: tuple[Task, ...] = ("generate", "forward", "finetune", "pretrain", "score", "hidden")
TUNINGS = ("lora", "prompt", "deep_prompt")


@dataclass(frozen=True)
class Procedure:
    """What to compile, in numbers: the task and the shapes of one call."""

    task: Task
    batch: int
    tokens: int
    prompts: int = 0  # trainable prompts in front (prompt and deep-prompt tuning)
    block: int | None = None  # hidden: the block whose output is wanted (None: the last)
    max_length: int | None = None  # generate: the session's length (None: tokens + prompts + 128)
    target_batch: int | None = None  # pretrain: samples per global step (None: batch)
    average_every: int = 0  # pretrain: steps between averaging rounds (0: no averaging)

    def span(self, num_blocks: int) -> tuple[int, int]:
        """The blocks the route must cover."""
        if self.task != "hidden" or self.block is None:
            return 0, num_blocks
        if not 0 <= self.block < num_blocks:
            raise BadInputError(f"--block {self.block}: the model has blocks 0 to {num_blocks - 1}")
        return 0, self.block + 1

    @property
    def session_length(self) -> int:
        length = self.max_length if self.max_length is not None else self.tokens + self.prompts + 128
        if length < self.tokens + self.prompts:
            raise BadInputError(f"--max-length {length} is shorter than the {self.tokens + self.prompts} positions")
        return length


def compile_plan(model: ModelShape, route: Sequence[Hop], proc: Procedure) -> Plan:
    """The plan of ``proc`` over ``route``; a call the IR's bounds refuse (a length, a prompt count) is bad input."""
    try:
        return _compile(model, route, proc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInputError(f"cannot plan this call: {e.title}.{where}: {first['msg']}") from None


def _compile(model: ModelShape, route: Sequence[Hop], proc: Procedure) -> Plan:
    call = Call(batch=proc.batch, tokens=proc.tokens)
    if proc.task == "generate":
        return generate_plan(model, route, call, max_length=proc.session_length, prompts=proc.prompts)
    if proc.task == "finetune":
        return finetune_plan(model, route, call, prompts=proc.prompts)
    if proc.task == "pretrain":
        target = proc.target_batch if proc.target_batch is not None else proc.batch
        return pretrain_plan(model, route, call, target_batch=target, average_every=proc.average_every)
    if proc.task == "score":
        return score_plan(model, route, call)
    if proc.task == "hidden":
        return hidden_plan(model, route, call)
    return forward_plan(model, route, call, prompts=proc.prompts)


def find_route(
    cfg: ClientConfig, model_id: str, num_blocks: int, fingerprints: frozenset[str] | None, proc: Procedure
) -> list[Hop]:
    """The route a client would take now: waits up to ``missing_blocks_wait`` for blocks nobody serves yet."""
    from swarm.client.retry import Retrier
    from swarm.client.routing import Mode
    from swarm.client.swarm_view import SwarmView
    from swarm.dht import start_dht
    from swarm.membership import swarm_key_for

    start, end = proc.span(num_blocks)  # bad shapes are refused before the DHT starts
    need = proc.batch * proc.session_length if proc.task == "generate" else 0
    store = start_dht(
        initial_peers=cfg.initial_peers,
        client_mode=True,
        timeout=cfg.timing.dht_start_timeout,
        call_timeout=cfg.timing.dht_timeout,
        swarm_key=swarm_key_for(cfg.swarm_key),
    )
    try:
        view = SwarmView(store, model_id, num_blocks, cfg, fingerprints)
        mode: Mode = "inference" if proc.task == "generate" else "forward"
        route = Retrier(view, cfg.timing).run(lambda: view.route(start, end, mode=mode), "route")
        if proc.task != "generate":
            return route
        # a session needs KV-cache room on every hop, as the client's own would; blocks that are served but
        # without room are no reason to wait for more blocks
        try:
            return view.route(start, end, mode="inference", min_cache_tokens=need)
        except MissingBlocksError:
            raise CacheFullError(
                f"no server of blocks {start}:{end} has KV-cache room for a session of {need} "
                "tokens (--batch x --max-length); try a shorter --max-length"
            ) from None
    finally:
        store.shutdown()  # the DHT child and its p2pd go with it


def _shape(model_id: str, config: PretrainedConfig) -> ModelShape:
    return ModelShape(
        model_id=model_id,
        num_blocks=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
    )


def plan_from_swarm(args: argparse.Namespace, cfg: ClientConfig) -> Plan:
    """Resolve the model (a card or folder, or a pre-training run), route over the swarm, compile."""
    from swarm.model_files import load_config, model_folder, served_fingerprints

    fingerprints: frozenset[str] | None
    if args.run is not None:
        from swarm.training.run import load_run

        run = load_run(args.run, cfg.cache_dir)
        model = _shape(run.model_id, run.hf_config())
        fingerprints = frozenset({run.fingerprint})
        batch = args.batch if args.batch is not None else run.micro_batch_size
        tokens = args.tokens if args.tokens is not None else run.seq_len
        target, every = run.target_batch_size, run.average_every
    else:
        card = load_model_card(args.model)
        folder = model_folder(card, cfg.cache_dir)
        model = _shape(card.name, load_config(folder))
        fingerprints = served_fingerprints(folder, cfg.cache_dir)  # only servers of these very weights
        batch = args.batch if args.batch is not None else 1
        tokens = args.tokens if args.tokens is not None else 128
        target, every = args.target_batch, args.average_every
    prompts = args.num_prompt_tokens if args.tuning in ("prompt", "deep_prompt") else 0
    proc = Procedure(
        task=args.task,
        batch=batch,
        tokens=tokens,
        prompts=prompts,
        block=args.block,
        max_length=args.max_length,
        target_batch=target,
        average_every=every,
    )
    route = find_route(cfg, model.model_id, model.num_blocks, fingerprints, proc)
    return compile_plan(model, route, proc)


def read_plan(path: Path) -> Plan:
    """A plan file (JSON or msgpack), validated as anything from the network is."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror}") from None
    try:
        return Plan.parse(data)
    except PlanError as e:
        raise PlanError(f"{path} is not a valid plan: {e}") from None


def write_outputs(plan: Plan, args: argparse.Namespace, title: str | None) -> list[Path]:
    """The files the flags ask for: the plan (JSON, msgpack), its DOT source, its pictures."""
    written: list[Path] = []
    if args.json is not None:
        written.append(_write(args.json, plan.to_json() + "\n"))
    if args.msgpack is not None:
        written.append(_write(args.msgpack, plan.to_msgpack()))
    if args.dot is not None or args.png is not None or args.svg is not None:
        dot = to_dot(plan, title)
        if args.dot is not None:
            written.append(_write(args.dot, dot))
        written += [render(dot, p) for p in (args.png, args.svg) if p is not None]
    return written


def _write(path: Path, data: str | bytes) -> Path:
    try:
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    except OSError as e:
        raise BadInputError(f"cannot write {path}: {e.strerror}") from None
    return path


def _title(args: argparse.Namespace, plan: Plan) -> str:
    what = f"{plan.task} plan of {plan.model_id}"
    if args.tuning is not None and plan.task in ("finetune", "generate", "forward"):
        what += f" ({args.tuning})"
    return what


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is less than {least}")
    return value


def _positive(text: str) -> int:
    return _count(text, 1)


def _natural(text: str) -> int:
    return _count(text, 0)


def _picture(suffix: str) -> Callable[[str], Path]:
    """A picture's path, whose suffix names its format."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() != suffix:
            raise argparse.ArgumentTypeError(f"{text}: the file name must end in {suffix}")
        return path

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="any live peers (required unless --check)")
    p.add_argument("--model", default="smollm2-135m", help="model card name or Hugging Face folder (smollm2-135m)")
    p.add_argument(
        "--run",
        type=Path,
        default=None,
        metavar="RUN.toml",
        help="pretrain: a run's file (its model, stages, micro-batch, batch and averaging)",
    )
    p.add_argument("--task", choices=TASKS, default="forward", help="the procedure (default forward)")
    p.add_argument("--batch", type=_positive, default=None, help="sequences per call (1; a run's micro-batch)")
    p.add_argument("--tokens", type=_positive, default=None, help="tokens per sequence (128; a run's seq_len)")
    p.add_argument("--block", type=_natural, default=None, metavar="K", help="hidden: the block whose output (last)")
    p.add_argument("--max-length", type=_positive, default=None, help="generate: session length (tokens + 128)")
    p.add_argument("--tuning", choices=TUNINGS, default=None, help="finetune, forward, generate: the adapter kind")
    p.add_argument("--num-prompt-tokens", type=_positive, default=16, help="prompt tunings: prompts in front (16)")
    p.add_argument("--target-batch", type=_positive, default=None, help="pretrain: samples per step (--batch)")
    p.add_argument("--average-every", type=_natural, default=0, help="pretrain: steps between averaging rounds (0)")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    p.add_argument("--cache-dir", type=Path, default=None, help="converted models (default ~/.cache/swarm)")
    p.add_argument("--check", type=Path, default=None, metavar="FILE", help="validate and print a plan file")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the plan as JSON")
    p.add_argument("--msgpack", type=Path, default=None, metavar="FILE", help="write the plan as msgpack")
    p.add_argument("--dot", type=Path, default=None, metavar="FILE", help="write the plan as Graphviz DOT")
    for suffix in FORMATS:
        if suffix != ".pdf":
            p.add_argument(
                f"--{suffix[1:]}",
                type=_picture(suffix),
                default=None,
                metavar="FILE",
                help=f"draw the plan as {suffix[1:].upper()} (Debian's graphviz)",
            )
    add_log_flags(p, "WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.check is None and not args.initial_peers:
        p.error("give --initial-peers MADDR ... (or --check FILE)")
    if args.run is not None and args.task != "pretrain":
        p.error("--run is for --task pretrain")
    if args.tuning is not None and args.task not in ("finetune", "forward", "generate"):
        p.error("--tuning is for --task finetune, forward or generate")

    configure_logging(args.log_level, args.log_format)

    def body() -> None:
        if args.check is not None:
            plan = read_plan(args.check)
        else:
            cfg = ClientConfig(
                initial_peers=tuple(args.initial_peers),
                timing=Timing(),
                cache_dir=args.cache_dir or default_cache_dir(),
                swarm_key=args.swarm_key,
            )
            plan = plan_from_swarm(args, cfg)
        print(table(plan))
        for path in write_outputs(plan, args, _title(args, plan)):
            print(f"wrote {path}")

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
