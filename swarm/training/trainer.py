"""A pre-training run's trainer: owns the embeddings, final norm and LM head (trainable too), reads text, and
drives micro-batches forward and backward through the run's stages.

A global step is ``target_batch_size`` samples over all trainers: each trainer keeps {step, samples} in its own
subkey of the DHT, and the step is done when the samples of everyone at that step reach the target. Each trainer
then steps its own optimizer on the mean gradient of the samples it processed; the stages do the same on what they
saw. Several trainers average their own parameters through hivemind every ``average_every`` steps."""

from __future__ import annotations

import logging
import os
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from swarm.averaging import OwnedAverager, average_round
from swarm.client.model import DistributedModelForCausalLM, _Swarm
from swarm.client.routing import Hop, eligible
from swarm.config import ClientConfig, Timing
from swarm.dht import read_all, store_own
from swarm.errors import StaleStepError
from swarm.training.data import Samples
from swarm.training.init import init_module
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 2
STALE_TRAINER = 60.0  # a trainer whose progress is older than this is gone


def build_local_parts(run: RunConfig, config) -> DistributedModelForCausalLM:
    """The trainer's model: embeddings, norm and head initialised by the run's per-tensor seeds (or read from the
    model the run continues from)."""
    model = DistributedModelForCausalLM(config)
    model.to_empty(device="cpu")
    if "from" in run.model:
        from swarm.client.model import LOCAL_PREFIXES
        from swarm.config import default_cache_dir, load_model_card
        from swarm.model_files import model_folder, read_tensors, weight_map

        folder = model_folder(load_model_card(run.model["from"]), default_cache_dir())
        state = read_tensors(folder, [k for k in weight_map(folder) if k.startswith(LOCAL_PREFIXES)])
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    else:
        init_module(model, "", config, run.seed)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


class _Publisher:
    """Keeps this trainer's progress in the DHT from a background thread, so a micro-batch never waits on a store."""

    def __init__(self, swarm: _Swarm, key: str, ttl: float, trainer_id: str) -> None:
        self.swarm, self.key, self.ttl, self.trainer_id = swarm, key, ttl, trainer_id
        self._value: dict | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()

    def set(self, step: int, samples: int) -> None:
        self._value = {"trainer": self.trainer_id, "step": step, "samples": samples}
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            value = self._value
            if value is None or self._closed:
                continue
            try:
                now = get_dht_time()
                store_own(self.swarm.dht, self.swarm.validator, self.key, dict(value, updated=now), now + self.ttl)
            except Exception as e:
                log.warning("could not publish progress: %s", e)
            time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        self._wake.set()


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        data: Samples,
        initial_peers: tuple[str, ...],
        *,
        timing: Timing | None = None,
        checkpoint_dir: Path | None = None,
        direct: str = "auto",
        average_trainers: bool = True,
    ) -> None:
        """``average_trainers``: start hivemind's averager for the trainers' own parameters (needs the main thread;
        used only while other trainers feed the run)."""
        self.run, self.data = run, data
        config = run.hf_config()
        config._attn_implementation = "sdpa"
        self.model = build_local_parts(run, config)
        cfg = ClientConfig(initial_peers=tuple(initial_peers), timing=timing or Timing(), direct=direct)
        self.model._swarm = _Swarm(cfg, run.model_id, config.num_hidden_layers, run.fingerprint)
        self.blocks = self.model.swarm.blocks
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=run.lr, betas=run.betas, eps=run.eps,
                                     weight_decay=run.weight_decay)  # fmt: skip
        self.step = 0  # global steps done
        self.position = 0  # samples consumed from the data
        self.samples = 0  # processed by this trainer in the current step
        self.processed = 0  # samples this trainer computed since it started (not those refused as stale)
        self.checkpoint_dir = checkpoint_dir or run.checkpoint_dir / "trainer"
        self.trainer_id = self.model.swarm.dht.peer_id.to_base58()
        self._publisher = _Publisher(self.model.swarm, run.trainers_key, cfg.timing.record_ttl * 10, self.trainer_id)
        self._others: tuple[float, int] = (-1e9, 0)  # (read at, samples of other trainers at this step)
        self._peers_seen = False  # other live trainers at the last read
        self._solo_recheck = 2 * max(cfg.timing.view_refresh, 1.0)  # seconds between looks while training alone
        # Trainers' own parameters are replicas too when several trainers feed the run. hivemind starts its averager
        # process from the main thread only, so it starts here (where a trainer is made), not at the first round.
        self.averager: OwnedAverager | None = None
        if average_trainers and run.average_every:
            prefix = f"{run.model_id}_trainers"
            self.averager = OwnedAverager.for_run([p.data for p in self.params], self.model.swarm.dht, prefix, run)
        self._pool = ThreadPoolExecutor(run.pipeline_depth, thread_name_prefix="micro-batch")
        self.load_latest_checkpoint()
        self._set_lr()

    def _set_lr(self) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.run.lr * self.run.lr_factor(self.step)

    # ---- one global step --------------------------------------------------------------------------------------------
    def _other_samples(self) -> int:
        """Samples other trainers processed for this step, read from the DHT at most twice a second while there are
        other trainers, and every few seconds while this one trains alone (a DHT read costs more than a step)."""
        read_at, cached = self._others
        if time.monotonic() - read_at < (0.5 if self._peers_seen else self._solo_recheck):
            return cached
        total, now, self._peers_seen = 0, get_dht_time(), False
        for value in read_all(self.model.swarm.dht, self.run.trainers_key):
            if not isinstance(value, dict) or value.get("trainer") == self.trainer_id:
                continue
            if now - float(value.get("updated", 0)) < STALE_TRAINER:
                self._peers_seen = True
            if value.get("step") == self.step:
                total += int(value.get("samples", 0))
        self._others = (time.monotonic(), total)
        return total

    def _micro_batch(self, batch: torch.Tensor) -> float:
        loss = self.model(input_ids=batch, labels=batch).loss
        (loss * batch.shape[0]).backward()  # a sum over samples: each party divides by the samples it saw
        return loss.item()

    def train_step(self) -> float:
        """Micro-batches until the swarm has processed the global batch, then this trainer's optimizer step. Returns
        the mean loss of this trainer's micro-batches (the batch's loss, when it is the only trainer).

        Up to ``pipeline_depth`` micro-batches are in flight at once (one thread each), so while one stage works
        on a micro-batch the next stage works on another: the stages' machines compute in parallel."""
        run, mb, losses = self.run, self.run.micro_batch_size, []
        start_step = self.step
        while self.step == start_step:
            room = run.target_batch_size - self.samples - self._other_samples()
            if room <= 0:
                break
            n = max(1, min(run.pipeline_depth, room // mb))
            self.blocks.train_tag = {"step": self.step, "samples": mb}
            batches = [self.data.batch(self.position + i * mb, mb) for i in range(n)]
            results = [self._pool.submit(self._micro_batch, b) for b in batches]
            stale, wave = None, []
            for result in results:
                try:
                    wave.append(result.result())
                except StaleStepError as e:  # another trainer finished the step: catch up with the swarm
                    stale = e
            losses += wave
            self.position += len(results) * mb  # a micro-batch refused as stale is dropped, never read twice
            self.samples += len(wave) * mb
            self.processed += len(wave) * mb
            if self._peers_seen:  # alone, only step boundaries are published (what peers catch up from)
                self._publisher.set(self.step, self.samples)
            if stale is not None:
                found = re.search(r"server step (\d+)", str(stale))
                self._apply_step(int(found.group(1)) if found else self.step + 1)
        if self.step == start_step:
            self._apply_step(self.step + 1)
        return statistics.fmean(losses) if losses else float("nan")

    def _apply_step(self, to_step: int) -> None:
        if self.samples:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(self.samples)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step, self.samples = max(to_step, self.step + 1), 0
        self._others = (-1e9, 0) if self._peers_seen else (self._others[0], 0)
        self._set_lr()
        self._publisher.set(self.step, 0)
        self._notify_step()
        if self.run.average_every and self.step % self.run.average_every == 0:
            self._average()
        if self.run.checkpoint_every and self.step % self.run.checkpoint_every == 0:
            self.save_checkpoint()

    def _notify_step(self) -> None:
        """Tell every stage server of the run that the step has begun, so replicas that saw none of its micro-batches
        step now and replicas reach their averaging rounds together. Best effort: a peer that misses it takes the
        step at its next request, or from the progress in the DHT."""
        hops = [Hop.of(r) for r in eligible(self.blocks.view.snapshot(), fingerprint=self.run.fingerprint)]
        meta = {"kind": "step", "start": 0, "end": 1, "train": {"step": self.step}}
        self.blocks.loop.run(self.blocks.remote.broadcast(hops, meta, self.blocks.timing.step_timeout))

    def _average(self) -> None:
        """Trainers' own parameters (embeddings, head) are replicas too: average them when there are several."""
        others = [v for v in read_all(self.model.swarm.dht, self.run.trainers_key) if isinstance(v, dict)]
        now = get_dht_time()
        if self.averager is None or sum(now - float(v.get("updated", 0)) < STALE_TRAINER for v in others) < 2:
            return
        average_round(self.averager, self.run, "trainer")

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / f"step-{self.step:07d}.pt"
        state = {
            "step": self.step,
            "position": self.position,
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.opt.state_dict(),
        }
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        for old in sorted(self.checkpoint_dir.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def load_latest_checkpoint(self) -> bool:
        found = sorted(self.checkpoint_dir.glob("step-*.pt")) if self.checkpoint_dir.is_dir() else []
        if not found:
            return False
        state = torch.load(found[-1], weights_only=True)
        self.model.load_state_dict(state["model"], strict=True)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.position, self.samples = int(state["step"]), int(state["position"]), 0
        self._set_lr()
        log.info("trainer resumed at step %d (sample %d)", self.step, self.position)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._publisher.close()
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        self.model.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
