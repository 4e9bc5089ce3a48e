"""A stage of a pre-training run, as the node serves it: its model is the run's (no weights file to serve: per-tensor
seeds, a checkpoint or a live replica), its weights learn, and it follows the swarm's global step."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path

import torch

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.broker.planner import PeerInfo, PlacementPlan, Policy
from peers.broker.stages import plan_stages
from peers.serving.config import ComputeConfig
from peers.serving.ports import Learner
from peers.serving.stage_port import ModelInfo, StageEnv
from peers.training.proofs import StepProofs
from peers.training.span_trainer import SpanTrainer
from peers.training.state_gate import StateCopy, StateGate
from swarm import wire
from swarm.config import Timing
from swarm.dht import dht_time
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.protocol import StateReply, StateRequest, StepNotice
from swarm.records import RoundRecord, ServerRecord, TrainerProgress, fresh, stage_servers
from swarm.training.checkpoints import state_digest
from swarm.training.init import block_prefix, init_module, layers_path, stage_state_bytes
from swarm.training.run import RunConfig, load_run
from swarm.training.state import signed_rounds, stage_sources, stage_state
from swarm.verdict import Local

log = logging.getLogger(__name__)
REJOIN_MAX_WAITS = 32  # follow periods between fruitless attempts to take the replicas' state, at most


class TrainableStage:
    def __init__(self, run: RunConfig, model: ModelInfo, device: str, checkpoint_dir: Path | None) -> None:
        self.run, self.model, self.device = run, model, device
        self.checkpoint_dir = checkpoint_dir  # None: the run's checkpoint directory / stage-A-B
        self.trainer: SpanTrainer | None = None
        self._env: StageEnv | None = None
        self.gate = StateGate(Timing().state_interval)  # replaced with the peer's timing on ``attach``
        self._rejoin_after, self._rejoin_wait = 0.0, Timing().step_follow_period  # see ``_rejoin``

    @classmethod
    def from_config(
        cls, run_file: Path, compute: ComputeConfig, cache_dir: Path, checkpoint_dir: Path | None
    ) -> TrainableStage:
        if compute.runtime != "torch":
            raise BadInputError(
                f"--train serves a stage whose weights learn (backward passes, optimizer steps): "
                f"only the torch runtime does that, not --runtime {compute.runtime}"
            )
        run = load_run(run_file, cache_dir)
        config = run.hf_config()
        if run.stages[-1].end != config.num_hidden_layers:
            raise BadInputError(
                f"run {run.name}: stages end at block {run.stages[-1].end}, the model has {config.num_hidden_layers}"
            )
        family = family_for(config)
        config = family.config  # with the attention implementation the family runs
        with torch.device("meta"):
            block = family.build_layer(0)
        per_block = sum(p.numel() for p in block.parameters()) * 4 * 4  # weights, gradients, two Adam moments
        # the fingerprint names the run: its weights change as it learns
        model = ModelInfo(run.model_id, config, family, torch.float32, f"trainable:{run.name}", per_block)
        return cls(run, model, compute.device, checkpoint_dir)

    @property
    def env(self) -> StageEnv:
        if self._env is None:
            raise RuntimeError("the stage is not attached to a peer yet")
        return self._env

    def attach(self, env: StageEnv) -> None:
        self._env = env
        self.gate = StateGate(env.timing.state_interval)

    def local_judge(self) -> Local | None:
        return None  # trained weights change every step: accusations are about frozen ones

    def check_pinned(self, span: Span) -> None:
        self.run.stage_of(span)

    # ---- loading ------------------------------------------------------------------------------------------------
    def _replicas(self, span: Span) -> list[ServerRecord]:
        return stage_servers(
            self.env.store.view(self.model.name, self.model.num_blocks),
            span,
            self.run.fingerprint,
            exclude=self.env.peer_id,
        )

    def _build(self, span: Span) -> SpanTrainer:
        m, run = self.model, self.run
        folder = run.source_folder()
        if folder is not None:
            layers = load_span(folder, m.family, span, torch.float32, self.device)
        else:
            with torch.device(self.device):
                layers = torch.nn.ModuleList(m.family.build_layer(i) for i in span)
            for i, layer in enumerate(layers):
                init_module(layer, block_prefix(m.config, span.start + i), m.config, run.seed)
        folder = self.checkpoint_dir or run.checkpoint_dir / f"stage-{span.start}-{span.end}"
        return SpanTrainer(run, layers, span, folder, layers_path(m.config))

    async def load(self, span: Span) -> tuple[SpanBackend, Learner | None]:
        """Build the stage, then take the freshest state that can be believed: the live replicas' (see
        ``swarm.training.state``), else this peer's last checkpoint, else the run's seeded initialisation (or the
        weights it continues from)."""
        self.run.stage_of(span)
        env = self.env
        trainer = await asyncio.to_thread(self._build, span)
        sources = await asyncio.to_thread(stage_sources, env.store, self.run, span, env.timing, env.peer_id)
        limit = stage_state_bytes(self.run, span)
        state = await stage_state(env.remote, sources, span, env.timing.state_timeout, limit)
        if state is None and sources.rounds:  # a round may have ended between the read and the download: once more
            sources = await asyncio.to_thread(stage_sources, env.store, self.run, span, env.timing, env.peer_id)
            state = await stage_state(env.remote, sources, span, env.timing.state_timeout, limit)
        if state is not None:
            trainer.import_state(*state)
            log.info("joined at step %d with the replicas' weights", trainer.step, extra={"span": str(span)})
        elif not await asyncio.to_thread(trainer.load_latest_checkpoint):
            log.info("starting from the run's initial weights", extra={"span": str(span)})
        trainer.set_replicas([r.peer_id for r in sources.replicas])
        trainer.proofs = StepProofs(self.run, env.timing.trainer_stale, env.timing.clock_skew)
        for p in await asyncio.to_thread(self._progress):  # the trainers' signed word on where the run is
            trainer.note(p.trainer, p.step)
        trainer.on_round = self._sign_round
        trainer.start_averager(env.store.dht)
        trainer.launch_averager()  # on the event loop's thread, the main thread, as hivemind requires
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = trainer
        m = self.model
        return SpanBackend(m.config, m.family, trainer.layers, span, self.device, torch.float32), trainer

    def _sign_round(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """Sign the state this replica ended an averaging round with (called on the compute thread after the round;
        the DHT write goes to a thread of its own, so no request waits on it)."""
        trainer, env = self.trainer, self.env
        if trainer is None:
            return
        span = trainer.span
        record = RoundRecord(
            peer_id=env.peer_id,
            start=span.start,
            end=span.end,
            step=step,
            digest=state_digest(state),
            updated=dht_time(),
        )

        def publish() -> None:
            try:
                env.store.publish(self.run.rounds_key(span), record, record.updated + env.timing.progress_ttl)
            except Exception as e:
                log.warning("could not sign the averaging round: %s", e, extra={"span": str(span)})

        threading.Thread(target=publish, name="sign-round", daemon=True).start()

    def probe(self) -> SpanBackend:
        """A freshly initialised block (nothing downloaded): what one block costs on this device."""
        m = self.model
        with torch.device(self.device):
            layer = m.family.build_layer(0)
        return SpanBackend(m.config, m.family, torch.nn.ModuleList([layer]), Span(0, 1), self.device, torch.float32)

    def plan(self, peers: list[PeerInfo], policy: Policy) -> PlacementPlan:
        return plan_stages(peers, self.run.stages, max(self.model.block_bytes, 1))

    # ---- the global step ----------------------------------------------------------------------------------------
    def background(self) -> list[Coroutine[object, None, None]]:
        return [self._follow_global_step()]

    async def _follow_global_step(self) -> None:
        """Keep the count of this stage's replicas, and step with the swarm even if no trainer's step notice arrived:
        the trainers publish their step in the DHT, and a stage behind it applies its own step (then averages when
        the period says so)."""
        env = self.env
        while True:
            await asyncio.sleep(env.timing.step_follow_period)
            trainer = self.trainer
            if trainer is None:
                continue
            try:
                trainer.set_replicas([r.peer_id for r in await asyncio.to_thread(self._replicas, trainer.span)])
                progress = await asyncio.to_thread(self._progress)
                for p in progress:
                    trainer.note(p.trainer, p.step)
                # as far as the trainers' word goes: one trainer's moves it a bounded number of steps
                signed = max((p.step for p in progress), default=0)
                target = min(signed, trainer.reach())
                if target > trainer.step:
                    log.info("the swarm is at step %d", target, extra={"span": str(trainer.span)})
                    await env.compute.run(trainer.catch_up, target)
                if trainer.health.wanted is not None:
                    await self._heal(trainer)
                elif max(signed, trainer.behind) > trainer.reach():
                    await self._rejoin(trainer)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("could not follow the global step: %s", e, extra={"peer": env.peer_id})

    async def _heal(self, trainer: SpanTrainer) -> None:
        """A replica apart from the others (``peers/training/replica_health.py``) takes a fresh copy of their state:
        fetched and believed as a joiner's is (``swarm.training.state``), and only a round that two other replicas
        signed alike when the replica itself looks sound."""
        wanted, env, span = trainer.health.wanted, self.env, trainer.span
        assert wanted is not None
        sources = await asyncio.to_thread(stage_sources, env.store, self.run, span, env.timing, env.peer_id)
        if wanted.majority_only and not signed_rounds(sources, span):
            return  # no majority to believe over its own state: it stays, and keeps averaging
        limit = stage_state_bytes(self.run, span)
        state = await stage_state(env.remote, sources, span, env.timing.state_timeout, limit)
        if state is None:
            log.warning("apart from its replicas, and no state of theirs to believe yet", extra={"span": str(span)})
            return
        await env.compute.run(trainer.heal, *state)

    async def _rejoin(self, trainer: SpanTrainer) -> None:
        """The run went on without this replica, further than one trainer's word moves it (it sat in a round that
        could not form while the trainer went on through its replicas): it takes their state, as a joiner does, if
        one is ahead of it. The trainers' word alone is not enough (``peers.training.proofs``: one self-signed step of
        10^12 must not end the schedule), so this costs a state download, and one that brings nothing ahead (no
        replica further on: the word was a lie, or the others are as far behind) doubles the wait before the next."""
        env, span = self.env, trainer.span
        if time.monotonic() < self._rejoin_after:
            return
        sources = await asyncio.to_thread(stage_sources, env.store, self.run, span, env.timing, env.peer_id)
        limit = stage_state_bytes(self.run, span)
        state = await stage_state(env.remote, sources, span, env.timing.state_timeout, limit)
        if state is not None and await env.compute.run(trainer.rejoin, *state):
            self._rejoin_wait = env.timing.step_follow_period
            return
        log.info("behind the trainers' word, and no replica's state ahead of it", extra={"span": str(span)})
        self._rejoin_wait = min(2 * self._rejoin_wait, REJOIN_MAX_WAITS * env.timing.step_follow_period)
        self._rejoin_after = time.monotonic() + self._rejoin_wait

    def _progress(self) -> list[TrainerProgress]:
        """The run's trainers' fresh progress records (blocking: a DHT read)."""
        progress = self.env.store.read(self.run.trainers_key, TrainerProgress)
        timing = self.env.timing
        recent = fresh(progress, dht_time(), timing.trainer_stale, timing.clock_skew)
        return [p for p in recent if self.run.is_trainer(p.trainer)]

    # ---- RPC: state requests and step notices --------------------------------------------------------------------
    @property
    def training(self) -> TrainableStage:
        return self

    def _held(self) -> SpanTrainer:
        if self.trainer is None:
            raise BadInputError("this peer holds no trainable stage yet")
        return self.trainer

    async def state(self, req: StateRequest, caller: str, budget: wire.ByteBudget | None) -> StateCopy:
        """The stage's weights and optimizer state, taken between requests on the compute thread: admitted as any
        compute request is (``Engine.queued``), and as a copy of the state (``StateGate``: copies held at
        once, per caller and in all, their bytes in ``budget``, and how often one caller gets one)."""
        trainer = self._held()
        if (req.start, req.end) != (trainer.span.start, trainer.span.end):
            raise BadInputError(f"this peer holds stage {trainer.span}, not {req.start}:{req.end}")
        if req.round and trainer.last_round is None:
            raise BadInputError("this replica has not ended an averaging round yet")
        release = self.gate.admit(caller, stage_state_bytes(self.run, trainer.span), budget)

        def current() -> tuple[int, dict[str, torch.Tensor], str | None]:
            state = trainer.export_state()
            return trainer.step, state, state_digest(state)

        try:
            held = trainer.last_round
            if req.round and held is not None:  # made by the averaging round, its digest signed in the DHT
                step, tensors, digest = await self.env.compute.run(lambda: (*held, None), small=True, caller=caller)
            else:
                step, tensors, digest = await self.env.compute.run(current, caller=caller)
        except BaseException:
            release()
            raise
        span = trainer.span
        return StateCopy(release, StateReply(step=step, start=span.start, end=span.end, digest=digest), tensors)

    async def step(self, notice: StepNotice) -> None:
        """A trainer finished a global step: take ours now (a replica that saw none of the step's micro-batches would
        otherwise wait for its next request), without making the trainer wait for it or for an averaging round.

        The notice counts only with its proof: the progress record of a trainer of the run at that step, signed by
        that trainer and recent. Even so, it moves the stage only as far as one trainer's word goes
        (``peers.training.proofs``): a notice of step 10^12 moves it at most ``catch_up_limit`` steps."""
        trainer = self._held()
        if notice.step > trainer.step:
            signed = trainer.vouch(notice.proof)
            if signed != notice.step:
                raise BadInputError(f"the notice is of step {notice.step}, its proof of step {signed}")
            target = min(notice.step, trainer.reach())
            if target < notice.step:
                log.info(
                    "a notice of step %d moves this stage to %d", notice.step, target, extra={"span": str(trainer.span)}
                )
            if target > trainer.step:
                self.env.compute.in_background(trainer.catch_up, target)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
