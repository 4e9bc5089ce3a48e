"""A trainable stage on one peer: its own AdamW, gradient accumulation up to the run's global batch, checkpoints,
and averaging with the stage's other replicas through hivemind.

Steps are counted globally. Every training request names the step its trainer is in; gradients accumulate for the
peer's current step, and the peer applies its optimizer step when it has seen the whole global batch itself (a sole
replica), or when a request or the trainers' progress in the DHT shows the swarm has moved on (replicas sharing
the batch). Gradients are normalised by the samples this peer saw, so a replica that saw half the batch steps on
that half's mean. Every party uses the same schedule of the global step, so the split changes nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from swarm.averaging import OwnedAverager, average_round
from swarm.errors import BadInputError, StaleStepError
from swarm.ids import Span
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 2


class SpanTrainer:
    def __init__(self, run: RunConfig, layers: torch.nn.ModuleList, span: Span, checkpoint_dir: Path) -> None:
        self.run, self.layers, self.span, self.checkpoint_dir = run, layers, span, checkpoint_dir
        layers.requires_grad_(True)
        self.names = [f"model.layers.{span.start + i}.{n}" for i, layer in enumerate(layers) for n, _ in
                      layer.named_parameters()]  # fmt: skip
        self.params = list(layers.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=run.lr, betas=run.betas, eps=run.eps,
                                     weight_decay=run.weight_decay)  # fmt: skip
        for p in self.params:  # Adam's state exists from the start, so the averager can hold it
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
        self.step = 0
        self.samples = 0  # seen for the current step
        self.unfinished = False  # the last step's averaging round and checkpoint are still to do
        self.averager: OwnedAverager | None = None
        self.replicas = 1  # how many peers serve this stage now (kept up to date by the node, from the DHT)
        self._set_lr()

    def _set_lr(self) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.run.lr * self.run.lr_factor(self.step)

    # ---- steps --------------------------------------------------------------------------------------------------
    def catch_up(self, step: int) -> None:
        """Take the optimizer steps the swarm has taken (none if already there), and finish the last one."""
        while self.step < step:
            self.apply_step()
        self.finish_step()

    def before_request(self, step: int) -> None:
        """Bring this stage to the trainer's step (one optimizer step behind is normal between batches)."""
        if step < self.step:
            raise StaleStepError(f"trainer at step {step}, but this stage is at step {self.step} (server step)")
        self.catch_up(step)

    def after_backward(self, samples: int) -> None:
        """Count a micro-batch; with the whole global batch seen here, step now (exact for a sole replica) but leave
        the averaging round and checkpoint to ``finish_step``, after the reply: the trainer must not wait for them."""
        self.samples += samples
        if self.samples >= self.run.target_batch_size:
            self.apply_step(finish=False)

    def finish_step(self) -> None:
        """Averaging round and checkpoint of the step just applied, if due."""
        if not self.unfinished:
            return
        self.unfinished = False
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
        self._set_lr()
        self.unfinished = True
        if finish:
            self.finish_step()

    # ---- replicas -----------------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """What replicas average and a joining peer downloads: parameters, then Adam's two moments."""
        state = [self.opt.state[p] for p in self.params]
        return [p.data for p in self.params] + [s["exp_avg"] for s in state] + [s["exp_avg_sq"] for s in state]

    def start_averager(self, dht) -> None:
        prefix = f"{self.run.model_id}_stage{self.span.start}-{self.span.end}"
        self.averager = OwnedAverager.for_run(self.tensors(), dht, prefix, self.run, start=False)

    def launch_averager(self) -> None:
        """From the main thread (see ``OwnedAverager.for_run``)."""
        if self.averager is not None and not self.averager.is_alive():
            self.averager.run_in_background(await_ready=True)

    def average(self) -> None:
        if self.averager is None or self.replicas < 2:
            return
        average_round(self.averager, self.run, str(self.span))

    def export_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(meta, tensors) for a joining replica or an export: weights by their model names, Adam's moments."""
        n = len(self.params)
        tensors = self.tensors()
        out = {f"param.{name}": t for name, t in zip(self.names, tensors[:n], strict=True)}
        out.update({f"exp_avg.{name}": t for name, t in zip(self.names, tensors[n : 2 * n], strict=True)})
        out.update({f"exp_avg_sq.{name}": t for name, t in zip(self.names, tensors[2 * n :], strict=True)})
        return {"step": self.step, "span": str(self.span)}, out

    def import_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        if meta.get("span") != str(self.span):
            raise BadInputError(f"state for blocks {meta.get('span')}, not {self.span}")
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(self.names, self.params, strict=True)):
                state = self.opt.state[p]
                for prefix, target in (("param.", p.data), ("exp_avg.", state["exp_avg"]),
                                       ("exp_avg_sq.", state["exp_avg_sq"])):  # fmt: skip
                    source = tensors.get(prefix + name)
                    if source is None or source.shape != target.shape:
                        raise BadInputError(f"state lacks a fitting {prefix}{name} (tensor {i})")
                    target.copy_(source)
                state["step"].fill_(float(meta["step"]))
        self.step, self.samples = int(meta["step"]), 0
        self.opt.zero_grad(set_to_none=True)
        self._set_lr()

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        meta, tensors = self.export_state()
        path = self.checkpoint_dir / f"step-{self.step:07d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"meta": meta, "tensors": {k: v.clone() for k, v in tensors.items()}}, tmp)
        os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous checkpoint intact
        for old in sorted(self.checkpoint_dir.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
            old.unlink()
        log.info("checkpoint saved at step %d", self.step, extra={"span": str(self.span)})
        return path

    def load_latest_checkpoint(self) -> bool:
        found = latest_checkpoint(self.checkpoint_dir)
        if found is None:
            return False
        data = torch.load(found, weights_only=True)
        self.import_state(data["meta"], data["tensors"])
        log.info("resumed from %s (step %d)", found.name, self.step, extra={"span": str(self.span)})
        return True

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(Path(folder).glob("step-*.pt")) if Path(folder).is_dir() else []
    return found[-1] if found else None
