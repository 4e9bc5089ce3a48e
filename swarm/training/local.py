"""The same training in one process: the reference the swarm's losses and weights are compared with (tests and
``scripts/bench_pretrain.py``). Same initialisation, data order, optimizer and schedule; one full batch per step."""

from __future__ import annotations

import torch

from swarm.training.data import Samples
from swarm.training.init import init_full_model
from swarm.training.run import RunConfig


class LocalTraining:
    def __init__(self, run: RunConfig, data: Samples) -> None:
        self.run, self.data = run, data
        config = run.hf_config()
        config._attn_implementation = "sdpa"
        if "from" in run.model:
            from transformers import AutoModelForCausalLM

            from swarm.config import default_cache_dir, load_model_card
            from swarm.model_files import model_folder

            folder = model_folder(load_model_card(run.model["from"]), default_cache_dir())
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        else:
            self.model = init_full_model(config, run.seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=run.lr, betas=run.betas, eps=run.eps,
                                     weight_decay=run.weight_decay)  # fmt: skip
        self.step = 0

    def train_step(self) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.run.lr * self.run.lr_factor(self.step)
        batch = self.data.batch(self.step * self.run.target_batch_size, self.run.target_batch_size)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()
