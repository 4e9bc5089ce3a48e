"""Cheating servers: a real ``swarm.serve`` peer (its own identity, DHT peer, record, transports and signed
commitments) whose blocks compute wrong answers, for the verification tests and benchmarks. The cheat sits in the
runtime the node is handed (``CheatingSpan`` around the torch ``SpanBackend``), below every path a request takes:
client-mediated and chained inference steps (and the pushes to the next hop), batched or alone, forward and
backward. So the server commits to the wrong output it sends, as a real cheater would; nothing else is broken.

    python scripts/cheating_server.py MODE [--fraction F] [--seed S] [--scale X] -- [swarm.serve arguments...]

Modes (``MODES``):

- ``honest``: no change (the same process, started honestly, for benchmarks).
- ``noise``: Gaussian noise added to the span's output, per position of std ``scale`` x that position's RMS; in a
  backward, the same relative noise on the input gradient it returns.
- ``quant4``: every ``nn.Linear`` weight of its blocks quantized at load: symmetric round-to-nearest int4, absmax per
  group of 32 along the input dimension, dequantized to the serving dtype (``quantize4``).
- ``swap``: one block of its span (``swap_blocks``: the second, or the only one) runs with the weights of its
  neighbour, read from the model folder.
- ``last``: the last position of each call's output replaced by Gaussian values of that position's RMS.
- ``int8``, ``nf4``: its blocks quantized at load exactly as ``--quantize int8|nf4`` holds them (the libraries'
  formats, ``peers.blocks.quantize``), while it announces the unquantized weights' fingerprint: a volunteer passing
  off a cheaper quantized copy as the real weights.

``--fraction F``: a call (one row of a batched step: one session's step) cheats with probability F, drawn by a
random generator seeded with ``--seed``, one draw per call in the order calls reach the runtime (``decisions``). For
``quant4`` and ``swap`` below 1, both copies of the weights are held and a call runs on one or the other. In the
backward of a forward kept for it, the noise mode's draw is the forward's; a backward that recomputes draws again.

Only the torch runtime cheats (``--runtime onnx`` is refused at start). A trainable stage (``--train``: a replica
of a pre-training run) cheats with ``noise`` or ``last`` only, on its forwards' outputs and (noise) the input
gradients its backwards return; its weights are the run's, so the weight cheats are refused there."""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from peers.blocks import batched
from peers.blocks.backend import SpanBackend
from peers.blocks.quantize import quantize_layer
from peers.serving.adapters import Adapter
from peers.serving.ports import Learner
from peers.serving.runtime import Row, SpanRuntime
from swarm.errors import BadInputError
from swarm.families.spec import Family
from swarm.families.weights import load_layers
from swarm.ids import Span
from swarm.records import Capability

MODES = ("honest", "noise", "quant4", "swap", "last", "int8", "nf4")
WEIGHT_MODES = ("quant4", "swap", "int8", "nf4")  # cheats held in the weights: the rest rewrite the output
GROUP = 32  # quant4: values sharing one scale, along a Linear's input dimension
LEVELS = 7  # quant4: symmetric int4 uses -7..7, so zero is exact and the grid is the same both ways


@dataclass(frozen=True)
class Cheat:
    """What a cheating server does (its command line)."""

    mode: str
    fraction: float = 1.0
    seed: int = 0
    scale: float = 1e-2


class Dice:
    """Which calls cheat and the garbage they get, from ``seed``: one draw per call, under a lock (small steps run on
    the RPC loop's thread while the compute thread runs another request)."""

    def __init__(self, cheat: Cheat) -> None:
        self.cheat = cheat
        self._rng = random.Random(cheat.seed)
        self._gen = torch.Generator().manual_seed(cheat.seed)
        self._lock = threading.Lock()

    def roll(self) -> bool:
        with self._lock:
            return self._rng.random() < self.cheat.fraction

    def randn(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            return torch.randn(shape, generator=self._gen, dtype=torch.float32)


def decisions(seed: int, fraction: float, calls: int) -> list[bool]:
    """Whether each of a server's first ``calls`` calls cheats (what its ``Dice`` draws)."""
    dice = Dice(Cheat("noise", fraction, seed))
    return [dice.roll() for _ in range(calls)]


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Each position's root mean square over the hidden dimension, in float32 (kept as a trailing dim of 1)."""
    return x.detach().float().pow(2).mean(-1, keepdim=True).sqrt()


def add_noise(x: torch.Tensor, dice: Dice) -> torch.Tensor:
    """``x`` plus Gaussian noise of std ``scale`` x each position's RMS (the graph through ``x`` is kept)."""
    noise = dice.randn(x.shape).to(x.device) * _rms(x) * dice.cheat.scale
    return x + noise.to(x.dtype)


def garble_last(x: torch.Tensor, dice: Dice) -> torch.Tensor:
    """``x`` with its last position replaced by Gaussian values of that position's RMS."""
    last = x[:, -1:]
    garbage = dice.randn(last.shape).to(x.device) * _rms(last)
    return torch.cat([x[:, :-1], garbage.to(x.dtype)], dim=1)


def quantize4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] through symmetric round-to-nearest int4 with an absmax scale per group of ``GROUP``
    values along ``in`` (the last group zero-padded), dequantized back to its dtype."""
    out_features, in_features = weight.shape
    x = F.pad(weight.detach().float(), (0, (-in_features) % GROUP)).reshape(out_features, -1, GROUP)
    scale = x.abs().amax(-1, keepdim=True) / LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    q = torch.clamp(torch.round(x / scale), -LEVELS, LEVELS)
    return (q * scale).reshape(out_features, -1)[:, :in_features].to(weight.dtype)


def quantize_layers(layers: torch.nn.Module) -> int:
    """Every ``nn.Linear`` weight of ``layers`` through ``quantize4``, in place; how many there were."""
    linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(quantize4(m.weight))
    return len(linears)


def swap_blocks(span: Span, num_blocks: int) -> tuple[int, int]:
    """(the block of ``span`` that runs on another's weights, the block whose weights it gets): the span's second
    block (its only one if it has one) and that block's next neighbour in the model (the previous one at the end)."""
    victim = span.start + 1 if len(span) >= 2 else span.start
    donor = victim + 1 if victim + 1 < num_blocks else victim - 1
    if donor < 0:
        raise BadInputError("swap needs a model of at least two blocks")
    return victim, donor


def swap_layer(layers: torch.nn.ModuleList, span: Span, family: Family, folder: Path, dtype: torch.dtype) -> None:
    """The victim block of ``layers`` (``swap_blocks``) given its donor's weights, read from ``folder``, in place.
    The module stays the victim's (its layer index, so its cache layer, and its attention kind)."""
    victim, donor = swap_blocks(span, family.num_layers)
    source = load_layers(family, folder, [donor], dtype, "cpu")[0]
    try:
        layers[victim - span.start].load_state_dict(source.state_dict(), strict=True)
    except RuntimeError as e:  # a model whose blocks differ in shape (dense and expert blocks)
        raise BadInputError(f"swap: block {donor}'s weights do not fit block {victim}: {str(e)[:300]}") from None


class CheatingSpan:
    """A torch span that cheats on the calls its dice pick (``peers.serving.runtime.SpanRuntime`` and ``Batcher``).
    ``cheat_backend`` runs the weight cheats (the honest backend itself when every call cheats)."""

    def __init__(self, honest: SpanBackend, cheat_backend: SpanBackend, dice: Dice) -> None:
        self.honest, self.cheat_backend, self.dice = honest, cheat_backend, dice
        self.name = honest.name
        self.capabilities: frozenset[Capability] = honest.capabilities
        self.config, self.span, self.device, self.dtype = honest.config, honest.span, honest.device, honest.dtype

    @property
    def mode(self) -> str:
        return self.dice.cheat.mode

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        return dict(self.honest.linears)

    def new_cache(self, max_length: int | None = None) -> object:
        return self.honest.new_cache(max_length)

    def weight_tensors(self) -> list[torch.Tensor]:
        extra = self.cheat_backend.weight_tensors() if self.cheat_backend is not self.honest else []
        return self.honest.weight_tensors() + extra

    def joins(self, cache: object) -> bool:
        return self.honest.joins(cache)

    def _backend(self, cheats: bool) -> SpanBackend:
        return self.cheat_backend if cheats and self.mode in WEIGHT_MODES else self.honest

    def _garble(self, out: torch.Tensor) -> torch.Tensor:
        if self.mode == "noise":
            return add_noise(out, self.dice)
        if self.mode == "last":
            return garble_last(out, self.dice)
        return out

    def run(
        self,
        hidden: torch.Tensor,
        sub: Span,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        past: int = 0,
        adapter: Adapter | None = None,
    ) -> torch.Tensor:
        cheats = self.dice.roll()
        if cheats and self.mode == "noise" and hidden.requires_grad and torch.is_grad_enabled():
            # the input gradient this call's backward returns gets the same relative noise as its output
            hidden = hidden.view_as(hidden)
            hidden.register_hook(lambda grad: add_noise(grad, self.dice))  # type: ignore[no-untyped-call]  # torch's
        out = self._backend(cheats).run(
            hidden,
            sub,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            past=past,
            adapter=adapter,
        )
        return self._garble(out) if cheats else out

    def run_batch(self, rows: list[Row], sub: Span) -> list[torch.Tensor]:
        """Each row (one session's step) is a call of its own: it draws, and with a weight cheat the rows that cheat
        run as one batch on the cheat's weights and the others as one on the honest weights."""
        cheats = [self.dice.roll() for _ in rows]
        groups = [[i for i, c in enumerate(cheats) if c == flag] for flag in (False, True)]
        if self.mode not in WEIGHT_MODES or self.cheat_backend is self.honest or not all(groups):
            outs = self._backend(any(cheats)).run_batch(rows, sub)
        else:
            before = batched.lengths(rows, sub)
            outs = [torch.empty(0)] * len(rows)
            try:
                for flag, group in zip((False, True), groups, strict=True):
                    done = self._backend(flag).run_batch([rows[i] for i in group], sub)
                    for i, out in zip(group, done, strict=True):
                        outs[i] = out
            except BaseException:
                batched.undo(rows, sub, before)  # the first group's tokens too: every row can run again alone
                raise
        return [self._garble(out) if c else out for out, c in zip(outs, cheats, strict=True)]


def cheating_span(honest: SpanBackend, cheat: Cheat, family: Family, folder: Path, dtype: torch.dtype) -> CheatingSpan:
    """``honest`` wrapped to cheat as ``cheat`` says. A weight cheat changes a copy of its layers (with ``fraction``
    below 1, when the honest ones still serve the other calls) or the layers themselves."""
    dice = Dice(cheat)
    if cheat.mode not in WEIGHT_MODES:
        return CheatingSpan(honest, honest, dice)
    layers = honest.layers if cheat.fraction >= 1 else copy.deepcopy(honest.layers)
    if cheat.mode == "quant4":
        if not quantize_layers(layers):
            raise BadInputError("quant4: this model's blocks hold no nn.Linear")
    elif cheat.mode in ("int8", "nf4"):
        if not sum(quantize_layer(layer, cheat.mode, dtype, honest.device) for layer in layers):
            raise BadInputError(f"{cheat.mode}: this model's blocks hold no linear map it can quantize")
    else:
        swap_layer(layers, honest.span, family, folder, dtype)
    if layers is honest.layers:
        return CheatingSpan(honest, honest, dice)
    return CheatingSpan(honest, SpanBackend(honest.config, family, layers, honest.span, honest.device, dtype), dice)


def install(cheat: Cheat) -> None:
    """Every span this process's serving stage loads cheats as ``cheat`` says (``honest``: nothing changes). The
    speed probe's block (``ServingStage.probe``) stays honest."""
    if cheat.mode == "honest":
        return
    from peers.blocks.serving_stage import ServingStage

    load = ServingStage.load

    async def cheating_load(self: ServingStage, span: Span) -> tuple[SpanRuntime, Learner | None]:
        runtime, learner = await load(self, span)
        if not isinstance(runtime, SpanBackend):
            raise BadInputError(f"a cheating server runs the torch runtime only, not {runtime.name}")
        m = self.model
        wrapped = await asyncio.to_thread(cheating_span, runtime, cheat, m.family, self.folder, m.dtype)
        return wrapped, learner

    ServingStage.load = cheating_load  # type: ignore[method-assign]
    if cheat.mode in WEIGHT_MODES:
        return
    from peers.training.trainable_stage import TrainableStage

    train_load = TrainableStage.load

    async def cheating_train_load(self: TrainableStage, span: Span) -> tuple[SpanBackend, Learner | None]:
        runtime, learner = await train_load(self, span)
        return CheatingSpan(runtime, runtime, Dice(cheat)), learner  # type: ignore[return-value]  # duck-typed

    TrainableStage.load = cheating_train_load  # type: ignore[method-assign]


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], not {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"a positive number, not {text}")
    return value


def parse(argv: list[str]) -> tuple[Cheat, list[str]]:
    """The cheat (arguments before ``--``) and ``swarm.serve``'s arguments (after it)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(
        prog="python scripts/cheating_server.py",
        usage="%(prog)s MODE [--fraction F] [--seed S] [--scale X] -- [swarm.serve arguments...]",
        description="A real swarm.serve peer whose blocks compute wrong answers (harness/cheats.py).",
    )
    p.add_argument("mode", choices=MODES)
    p.add_argument("--fraction", type=_fraction, default=1.0, help="share of calls that cheat (seeded draws)")
    p.add_argument("--seed", type=int, default=0, help="seeds which calls cheat and the noise")
    p.add_argument("--scale", type=_positive, default=1e-2, help="noise: std relative to each position's RMS")
    args = p.parse_args(argv[:cut])
    return Cheat(args.mode, args.fraction, args.seed, args.scale), argv[cut + 1 :]


def main(argv: list[str]) -> int:
    cheat, serve_argv = parse(argv)
    from swarm.serve import build_parser, config_from_args
    from swarm.serve import main as serve

    cfg = config_from_args(build_parser().parse_args(serve_argv))
    if cfg.compute.runtime != "torch":
        print(
            f"cheating_server: only the torch runtime cheats; --runtime {cfg.compute.runtime} refused", file=sys.stderr
        )
        return 2
    if cfg.train and cheat.mode in WEIGHT_MODES:
        print(
            f"cheating_server: a trainable stage (--train) holds the run's weights; {cheat.mode} refused",
            file=sys.stderr,
        )
        return 2
    install(cheat)
    print(f"cheating_server: {cheat}", file=sys.stderr, flush=True)
    return serve(serve_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
