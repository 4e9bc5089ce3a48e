"""A trainable span of a pre-training run on one peer: its weights, AdamW state and global step.

A global step ends when the swarm has processed ``target_batch_size`` samples. The stage accumulates its weights'
gradients (a sum over samples) and the count of samples it saw, then steps on their mean: a stage that saw the
whole batch steps at once (exactly what one process would do); a replica that saw half the batch steps on
that half's mean. Every party uses the same schedule of the global step, so the split changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from swarm.averaging import OwnedAverager
from swarm.dht import OwnedDHT
from swarm.errors import BadInputError, StaleStepError
from swarm.ids import Span
from swarm.protocol import TrainTag
from swarm.training import checkpoints
from swarm.training.checkpoints import StageCheckpoint
from swarm.training.optim import make_optimizer, set_lr
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
STATE_PARTS = ("param.", "exp_avg.", "exp_avg_sq.")  # a state's tensors: weights, then Adam's two moments


class SpanTrainer:
    def __init__(self, run: RunConfig, layers: torch.nn.ModuleList, span: Span, checkpoint_dir: Path) -> None:
        self.run, self.layers, self.span, self.checkpoint_dir = run, layers, span, checkpoint_dir
        layers.requires_grad_(True)
        self.names = [f"model.layers.{span.start + i}.{n}" for i, layer in enumerate(layers)
                      for n, _ in layer.named_parameters()]  # fmt: skip
        self.params: list[torch.nn.Parameter] = list(layers.parameters())
        self.opt = make_optimizer(self.params, run)
        for p in self.params:  # Adam's state exists from the start, so the averager can hold it
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
        self.step = 0
        self.samples = 0  # seen for the current step
        self._unfinished = False  # the last step's averaging round and checkpoint are still to do
        self.averager: OwnedAverager | None = None
        self.replicas = 1  # how many peers serve this stage now (kept up to date from the DHT)

    # ---- steps (on the compute thread) --------------------------------------------------------------------------
    def admit(self, tag: TrainTag) -> None:
        """Bring this stage to the trainer's step (one optimizer step behind is normal between batches); a request
        of a step already done is refused with the stage's step, so the trainer catches up."""
        if tag.step < self.step:
            raise StaleStepError(f"trainer at step {tag.step}, this stage at step {self.step}", server_step=self.step)
        self.catch_up(tag.step)

    def catch_up(self, step: int) -> None:
        """Take the optimizer steps the swarm has taken (none if already there), and finish the last one."""
        while self.step < step:
            self.apply_step()
        self.finish_step()

    def accumulate(self, grads: Sequence[torch.Tensor | None], samples: int) -> None:
        """Add a micro-batch's weight gradients; with the whole global batch seen here, step now (exact for a sole
        replica) but leave the averaging round and checkpoint to ``finish_step``, after the reply: the trainer must
        not wait for them."""
        for p, g in zip(self.params, grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.samples += samples
        if self.samples >= self.run.target_batch_size:
            self.apply_step(finish=False)

    @property
    def pending(self) -> bool:
        return self._unfinished

    def finish_step(self) -> None:
        """Averaging round and checkpoint of the step just applied, if due."""
        if not self._unfinished:
            return
        self._unfinished = False
        if self.run.average_every and self.step % self.run.average_every == 0:
            self.average()
        if self.run.checkpoint_every and self.step % self.run.checkpoint_every == 0:
            self.save_checkpoint()

    def apply_step(self, finish: bool = True) -> None:
        self.finish_step()  # a deferred round of the previous step comes first
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    # A replica that saw none of this step's micro-batches still steps, on a zero gradient: Adam's
                    # momentum carries it on (and weight decay applies) as on the replicas that saw them. Left idle
                    # it would drag every averaging round back toward where it stood.
                    p.grad = torch.zeros_like(p)
                elif self.samples:
                    p.grad.div_(self.samples)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        log.info("step %d applied (%d samples)", self.step + 1, self.samples, extra={"span": str(self.span)})
        self.step, self.samples = self.step + 1, 0
        set_lr(self.opt, self.run, self.step)
        self._unfinished = True
        if finish:
            self.finish_step()

    # ---- replicas -----------------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """What replicas average and a joining peer downloads: parameters, then Adam's two moments."""
        state = [self.opt.state[p] for p in self.params]
        return [p.data for p in self.params] + [s["exp_avg"] for s in state] + [s["exp_avg_sq"] for s in state]

    def start_averager(self, dht: OwnedDHT) -> None:
        prefix = f"{self.run.model_id}_stage{self.span.start}-{self.span.end}"
        self.averager = OwnedAverager.for_run(self.tensors(), dht, prefix, self.run, start=False)

    def launch_averager(self) -> None:
        """From the main thread (see ``OwnedAverager.for_run``)."""
        if self.averager is not None and not self.averager.is_alive():
            self.averager.run_in_background(await_ready=True)

    def average(self) -> None:
        if self.averager is not None and self.replicas >= 2:
            self.averager.average_round(self.run, str(self.span))

    def export_state(self) -> dict[str, torch.Tensor]:
        """Weights and Adam's moments by their model names (copies), for a joining replica or an export."""
        n = len(self.params)
        tensors = self.tensors()
        return {part + name: t.clone() for k, part in enumerate(STATE_PARTS)
                for name, t in zip(self.names, tensors[k * n : (k + 1) * n], strict=True)}  # fmt: skip

    def import_state(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(self.names, self.params, strict=True)):
                state = self.opt.state[p]
                for part, target in zip(STATE_PARTS, (p.data, state["exp_avg"], state["exp_avg_sq"]), strict=True):
                    source = tensors.get(part + name)
                    if source is None or source.shape != target.shape or source.dtype != target.dtype:
                        raise BadInputError(f"state lacks a fitting {part}{name} (tensor {i})")
                    target.copy_(source)
                state["step"].fill_(float(step))
        self.step, self.samples = step, 0
        self.opt.zero_grad(set_to_none=True)
        set_lr(self.opt, self.run, self.step)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        checkpoint = StageCheckpoint(step=self.step, span=str(self.span), tensors=self.export_state())
        path = checkpoints.save(self.checkpoint_dir, checkpoint)
        log.info("checkpoint saved at step %d", self.step, extra={"span": str(self.span)})
        return path

    def load_latest_checkpoint(self) -> bool:
        checkpoint = checkpoints.load_latest(self.checkpoint_dir, StageCheckpoint)
        if checkpoint is None:
            return False
        if checkpoint.span != str(self.span):
            raise BadInputError(f"checkpoint in {self.checkpoint_dir} is of blocks {checkpoint.span}")
        self.import_state(checkpoint.step, checkpoint.tensors)
        log.info("resumed from its checkpoint (step %d)", self.step, extra={"span": str(self.span)})
        return True

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
