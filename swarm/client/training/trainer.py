"""A pre-training run's trainer: owns the embeddings, final norm and LM head (trainable too), reads text, and
drives micro-batches forward and backward through the run's stages, with the client's public API only.

A global step is ``target_batch_size`` samples over all trainers: each trainer keeps its ``TrainerProgress`` in its
own subkey of the DHT, and the step is done when the samples of everyone at that step reach the target. Each trainer
then steps its own optimizer on the mean gradient of the samples it processed; the stages do the same on what they
saw. Several trainers average their own parameters through hivemind every ``average_every`` steps."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from swarm.client.executor import Handler
from swarm.client.model import DistributedModelForCausalLM
from swarm.client.training.crosscheck import CrossCheckConfig, CrossChecker
from swarm.config import DirectPolicy, Timing, client_config
from swarm.dht import RecordStore, dht_time
from swarm.errors import StaleStepError
from swarm.identity import Signed
from swarm.plan.ir import AnyNode
from swarm.protocol import TrainTag
from swarm.records import TrainerProgress, fresh
from swarm.training import checkpoints
from swarm.training.averaging import OwnedAverager
from swarm.training.checkpoints import TrainerCheckpoint
from swarm.training.data import Samples
from swarm.training.diloco import OUTER_PARTS as OUTER
from swarm.training.diloco import OuterSync
from swarm.training.init import initial_client_state
from swarm.training.optim import make_optimizer, set_lr
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)


def _ignoring_node(update: Callable[[], None]) -> Handler:
    """An update as the plan's handler of its node (the update needs nothing of the node)."""

    def handle(_node: AnyNode) -> None:
        update()

    return handle


class _Publisher:
    """Keeps this trainer's progress in the DHT from a background thread, so a micro-batch never waits on a store."""

    def __init__(self, store: RecordStore, key: str, timing: Timing, trainer_id: str) -> None:
        self.store, self.key, self.timing, self.trainer_id = store, key, timing, trainer_id
        self._value: tuple[int, int] | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()

    def set(self, step: int, samples: int) -> None:
        self._value = (step, samples)
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            value = self._value
            if value is None or self._closed:
                continue
            try:
                now = dht_time()
                record = TrainerProgress(trainer=self.trainer_id, step=value[0], samples=value[1], updated=now)
                self.store.publish(self.key, record, now + self.timing.progress_ttl)
            except Exception as e:
                log.warning("could not publish progress: %s", e)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(self.timing.shutdown_timeout)


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        data: Samples,
        initial_peers: tuple[str, ...],
        *,
        timing: Timing | None = None,
        checkpoint_dir: Path | None = None,
        direct: DirectPolicy = "auto",
        average_trainers: bool = True,
        wiring_seed: int | None = None,
        identity: Path | None = None,
        swarm_key: Path | None = None,
        crosscheck: CrossCheckConfig | None = None,
        chain: bool = True,
    ) -> None:
        """``average_trainers``: start hivemind's averager for the trainers' own parameters (needs the main thread;
        used only while other trainers feed the run). ``identity``: this trainer's key file (its peer id is what a
        closed run lists in ``[trust] trainers``). ``swarm_key``: a private swarm's key file. ``crosscheck``: run
        a sampled share of hops again on a second replica and compare (``swarm/client/training/crosscheck.py``).
        ``chain``: each micro-batch's forward and backward pass from stage to stage (``chained_passes``); False:
        through this trainer between stages."""
        self.run, self.data = run, data
        self.timing = timing or Timing()
        config = run.hf_config()
        state = initial_client_state(run, DistributedModelForCausalLM.local_tensor_names(config))
        client = client_config(
            initial_peers,
            self.timing,
            run.cache_dir,
            direct,
            wiring_seed=wiring_seed,
            identity=identity,
            swarm_key=swarm_key,
            chain=chain,
        )
        self.model = DistributedModelForCausalLM.from_parts(
            config, state, model_id=run.model_id, client=client, fingerprint=run.fingerprint
        )
        self.model.pretraining(run.target_batch_size, run.average_every)  # its plans carry the step's update
        self.params = list(self.model.parameters())
        self.crosscheck: CrossChecker | None = None
        if crosscheck is not None:
            self.crosscheck = CrossChecker(self.model.connection, run, crosscheck)
            self.model.runner.chain.crosscheck = self.crosscheck
        self.opt = make_optimizer(self.params, run)
        self.step = 0  # global steps done
        self.position = 0  # samples consumed from the data
        self.samples = 0  # processed by this trainer in the current step
        self.processed = 0  # samples this trainer computed since it started (not those refused as stale)
        self.checkpoint_dir = checkpoint_dir or run.checkpoint_dir / "trainer"
        self.store = self.model.connection.store
        self.trainer_id = self.model.connection.peer_id
        self._publisher = _Publisher(self.store, run.trainers_key, self.timing, self.trainer_id)
        self._others: tuple[float, int] = (-1e9, 0)  # (read at, samples of other trainers at this step)
        self._peers_seen = False  # other live trainers at the last read
        self._signed: tuple[float, Signed | None] = (0.0, None)  # (made at, this trainer's signed progress)
        self._signed_step = -1
        # Trainers' own parameters are replicas too when several trainers feed the run. hivemind starts its averager
        # process from the main thread only, so it starts here (where a trainer is made), not at the first round.
        self.averager: OwnedAverager | None = None
        self.outer = OuterSync(self.params, run.sync) if run.sync.method == "diloco" else None
        if average_trainers and run.average_every:
            prefix = f"{run.model_id}_trainers"
            if self.outer is not None:  # DiLoCo: the trainers' pseudo-gradients (``swarm/training/diloco.py``)
                self.averager = OwnedAverager.for_run(
                    self.outer.buffers, self.store.dht, f"{prefix}_diloco", run, codec=run.sync.compression
                )
            else:
                self.averager = OwnedAverager.for_run([p.data for p in self.params], self.store.dht, prefix, run)
        self._pool = ThreadPoolExecutor(run.pipeline_depth, thread_name_prefix="micro-batch")
        self.load_latest_checkpoint()

    # ---- one global step --------------------------------------------------------------------------------------------
    def _progress(self) -> list[TrainerProgress]:
        progress = self.store.read(self.run.trainers_key, TrainerProgress)
        return fresh(progress, dht_time(), self.timing.trainer_stale, self.timing.clock_skew)

    def _other_samples(self) -> int:
        """Samples other trainers processed for this step, read from the DHT every ``progress_poll`` while there are
        other trainers, and every ``solo_poll`` while this one trains alone (a DHT read costs more than a step)."""
        read_at, cached = self._others
        poll = self.timing.progress_poll if self._peers_seen else self.timing.solo_poll
        if time.monotonic() - read_at < poll:
            return cached
        others = [p for p in self._progress() if p.trainer != self.trainer_id and self.run.is_trainer(p.trainer)]
        self._peers_seen = bool(others)
        total = sum(min(p.samples, self.run.target_batch_size) for p in others if p.step == self.step)
        self._others = (time.monotonic(), total)
        return total

    def _proof(self) -> Signed:
        """This trainer's progress at its step, signed: a stage behind takes the step on it. Signed again when the
        step changes, and before stages would find it stale."""
        made, proof = self._signed
        if proof is None or self._signed_step != self.step or time.monotonic() - made > self.timing.trainer_stale / 3:
            progress = TrainerProgress(trainer=self.trainer_id, step=self.step, samples=0, updated=dht_time())
            proof = self.store.sign(progress)
            self._signed, self._signed_step = (time.monotonic(), proof), self.step
        return proof

    def _believed(self, server_step: int | None) -> int:
        """The step a stage says the swarm is at, believed as far as one step ahead of this trainer, or as far as
        a trainer of the run signed (a joining trainer catches up at once; a lying server moves it by one step)."""
        if server_step is None or server_step <= self.step + 1:
            return self.step + 1
        signed = max((p.step for p in self._progress() if self.run.is_trainer(p.trainer)), default=self.step)
        return min(server_step, max(signed, self.step + 1))

    def _micro_batch(self, batch: torch.Tensor, tag: TrainTag, position: int) -> float:
        """One micro-batch (in a pool thread), wired by a generator of its own: keyed by its ``position`` in the
        data, so its route does not depend on which thread runs it or when."""
        tag = tag.model_copy(update={"micro": str(position)})  # a stage adds this micro-batch's gradient once
        with self.model.connection.view.wiring(position):
            loss = self.model(input_ids=batch, labels=batch, train=tag).loss
            (loss * batch.shape[0]).backward()  # a sum over samples: each party divides by the samples it saw
        return float(loss.item())

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
            tag = TrainTag(step=self.step, samples=mb, trainer=self.trainer_id, proof=self._proof())
            positions = [self.position + i * mb for i in range(n)]
            results = [self._pool.submit(self._micro_batch, self.data.batch(p, mb), tag, p) for p in positions]
            stale: StaleStepError | None = None
            wave = []
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
                self._apply_step(self._believed(stale.server_step))
        if self.step == start_step:
            self._apply_step(self.step + 1)
        return statistics.fmean(losses) if losses else float("nan")

    def _apply_step(self, to_step: int) -> None:
        """The update phase of the pre-training plan: the optimizer step, then the averaging round when due."""
        updates: dict[str, Callable[[], None]] = {
            "optimizer_step": lambda: self._optimizer_step(to_step),
            "average": self._average_due,
        }
        last = self.model.runner.last
        if last is not None and last[0].task == "pretrain":
            handlers: dict[str, Handler] = {op: _ignoring_node(update) for op, update in updates.items()}
            self.model.run_update(handlers)
        else:  # no micro-batch of this step ran here (others completed it): the same update, in the same order
            for update in updates.values():
                update()
        if self.run.checkpoint_every and self.step % self.run.checkpoint_every == 0:
            self.save_checkpoint()

    def _average_due(self) -> None:
        if self.run.average_every and self.step % self.run.average_every == 0:
            self._average()

    def _optimizer_step(self, to_step: int) -> None:
        if self.samples:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(self.samples)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step, self.samples = max(to_step, self.step + 1), 0
        self._others = (-1e9, 0) if self._peers_seen else (self._others[0], 0)
        set_lr(self.opt, self.run, self.step)
        self._publisher.set(self.step, 0)
        # Every stage server hears that the step began, so replicas that saw none of its micro-batches step now and
        # reach their averaging rounds together. A peer that misses it takes the step at its next request, or from
        # the progress in the DHT. Not waited for: the next micro-batches carry the same signed progress (signed
        # once), and waiting for every server's answer cost about 5 ms a step on loopback.
        self.model.notify_step(self.step, self._proof(), wait=False)

    def _average(self) -> None:
        """Trainers' own parameters (embeddings, head) are replicas too: average them when there are several.
        Under DiLoCo the outer step comes here (on this trainer's own pseudo-gradient when it trains alone)."""
        others = [
            p.trainer for p in self._progress() if p.trainer != self.trainer_id and self.run.is_trainer(p.trainer)
        ]
        if self.averager is not None and others:
            self.averager.allow(others)
            if self.outer is not None:
                self.outer.prepare()
            done = self.averager.average_round(self.run, "trainer")
            if self.outer is not None and done and all(bool(torch.isfinite(t).all()) for t in self.outer.buffers):
                self.outer.step(self.outer.buffers)
        elif self.outer is not None:
            self.outer.step()

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        model = {k: v.clone() for k, v in self.model.state_dict().items()}
        outer = {} if self.outer is None else self._outer_state()
        checkpoint = TrainerCheckpoint(
            step=self.step, position=self.position, model=model, optimizer=self.opt.state_dict(), outer=outer
        )
        return checkpoints.save(self.checkpoint_dir, checkpoint)

    def _outer_state(self) -> dict[str, torch.Tensor]:
        assert self.outer is not None
        names = [n for n, _ in self.model.named_parameters()]
        return {part + n: t.clone() for part, ts in self.outer.state().items() for n, t in zip(names, ts, strict=True)}

    def load_latest_checkpoint(self) -> bool:
        state = checkpoints.load_latest(self.checkpoint_dir, TrainerCheckpoint)
        if state is None:
            return False
        self.model.load_state_dict(state.model, strict=True)
        self.opt.load_state_dict(state.optimizer)
        if self.outer is not None:
            names = [n for n, _ in self.model.named_parameters()]
            self.outer.load({part: [state.outer[part + n] for n in names] if state.outer else None for part in OUTER})
        self.step, self.position, self.samples = state.step, state.position, 0
        set_lr(self.opt, self.run, self.step)
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

    def __exit__(self, *exc: object) -> None:
        self.close()
