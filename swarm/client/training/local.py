"""The same training in one process: the reference the swarm's losses and weights are compared with (tests and
``scripts/bench_pretrain.py``). Same initial weights, data order, optimizer and schedule; one full batch per step."""

from __future__ import annotations

from swarm.training.data import Samples
from swarm.training.diloco import OuterSync
from swarm.training.init import initial_model
from swarm.training.optim import make_optimizer, set_lr
from swarm.training.run import RunConfig


class LocalTraining:
    def __init__(self, run: RunConfig, data: Samples) -> None:
        self.run, self.data = run, data
        self.model = initial_model(run)
        self.opt = make_optimizer(self.model.parameters(), run)
        self.step = 0
        # one-replica DiLoCo: the outer step on its own pseudo-gradient every ``average_every`` steps
        self.outer = OuterSync(list(self.model.parameters()), run.sync) if run.sync.method == "diloco" else None

    def train_step(self) -> float:
        set_lr(self.opt, self.run, self.step)
        batch = self.data.batch(self.step * self.run.target_batch_size, self.run.target_batch_size)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        if self.outer is not None and self.run.average_every and self.step % self.run.average_every == 0:
            self.outer.step()
        return float(loss.item())
