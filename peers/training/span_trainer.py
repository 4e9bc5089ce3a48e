"""A trainable span of a pre-training run on one peer: its weights, AdamW state and global step.

A global step ends when the swarm has processed ``target_batch_size`` samples. The stage accumulates its weights'
gradients (a sum over samples) and the count of samples it saw, then steps on their mean: a stage that saw the
whole batch steps at once (exactly what one process would do); a replica that saw half the batch steps on
that half's mean. Every party uses the same schedule of the global step, so the split changes nothing."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from peers.training.outer_rounds import OuterRounds
from peers.training.proofs import StepClaims, StepProofs
from peers.training.replica_health import ReplicaHealth
from peers.training.state_parts import STATE_PARTS, parse_state
from swarm.dht import dht_time
from swarm.errors import BadInputError, BusyError, StaleStepError
from swarm.identity import Signed
from swarm.ids import Span
from swarm.owned_dht import OwnedDHT
from swarm.protocol import TrainTag
from swarm.training import checkpoints
from swarm.training.averaging import OwnedAverager
from swarm.training.checkpoints import StageCheckpoint
from swarm.training.diloco import OUTER_PARTS, Outcome, OuterSync
from swarm.training.optim import make_optimizer, set_lr
from swarm.training.run import RunConfig

log = logging.getLogger(__name__)
GARBAGE = 1000.0  # a contribution this many times above the run's gradient bound is refused, not scaled


class SpanTrainer:
    def __init__(
        self, run: RunConfig, layers: torch.nn.ModuleList, span: Span, checkpoint_dir: Path, path: str = "model.layers"
    ) -> None:
        """``path``: where the family's causal LM keeps its blocks (``transformer.h``): the state's tensor names are
        those of a Hugging Face checkpoint of the run."""
        self.run, self.layers, self.span, self.checkpoint_dir = run, layers, span, checkpoint_dir
        layers.requires_grad_(True)
        self.names = [
            f"{path}.{span.start + i}.{n}" for i, layer in enumerate(layers) for n, _ in layer.named_parameters()
        ]
        self.params: list[torch.nn.Parameter] = list(layers.parameters())
        self.opt = make_optimizer(self.params, run)
        for p in self.params:  # Adam's state exists from the start, so the averager can hold it
            self.opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        self.step = 0
        self.behind = 0  # a signed step this replica was asked for that one trainer's word cannot move it to
        self.samples = 0  # seen for the current step
        self.by_trainer: Counter[str] = Counter()  # the current step's samples, by the trainer that sent them
        self.micro_seen: set[tuple[str, str]] = set()  # the current step's micro-batches, by trainer
        self.claims = StepClaims(run)  # the steps trainers signed, and how far they let this stage go
        self.proofs: StepProofs | None = None  # how signed progress is checked (set by the stage)
        self.clipped = 0  # contributions scaled down to the run's gradient bound
        self.last_round: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, state) of the last averaging
        self.on_round: Callable[[int, dict[str, torch.Tensor]], None] | None = None  # publishes its signed digest
        self._unfinished = False  # the last step's averaging round and checkpoint are still to do
        self.averager: OwnedAverager | None = None
        self.replicas = 1  # how many peers serve this stage now (kept up to date from the DHT)
        self.groupmates: frozenset[str] = frozenset()  # the others: the only peers its averaging rounds admit
        self.outer = OuterSync(self.params, run.sync) if run.sync.method == "diloco" else None
        self.rounds = None if self.outer is None else OuterRounds(self.outer, run, str(span), self._ended)
        self.health = ReplicaHealth(run, self.params, str(span))  # whether it is apart from its replicas

    # ---- steps (on the compute thread) --------------------------------------------------------------------------
    def admit(self, tag: TrainTag) -> None:
        """Bring this stage to the trainer's step (one optimizer step behind is normal between batches); a request
        of a step already done is refused with the stage's step, so the trainer catches up. A request from a peer
        the run does not list, or of a step no trainer of the run signed, changes nothing."""
        if not self.run.is_trainer(tag.trainer):
            raise BadInputError(f"{tag.trainer or 'an unnamed peer'} is not a trainer of run {self.run.name}")
        if self.health.off and self.health.wanted is not None:  # its weights are wrong by its own check: no pass
            raise BusyError(f"this replica is taking its replicas' state ({self.health.wanted.reason})")
        if tag.step < self.step:
            raise StaleStepError(f"trainer at step {tag.step}, this stage at step {self.step}", server_step=self.step)
        if tag.step == self.step and self.samples >= self.run.target_batch_size:
            # the batch is complete here, and the step waits for a trainer's signature: tell this one to move on
            raise StaleStepError(f"step {self.step}'s batch is complete", server_step=self.step + 1)
        if tag.step > self.step:
            self.vouch(tag.proof)
            if self.reach(work=True) < tag.step <= self.claims.highest:  # the run went on without this replica
                self.behind = max(self.behind, tag.step)
                raise BusyError(
                    f"this replica is at step {self.step}, more than {self.claims.bound} behind the trainer's "
                    f"{tag.step}: it is taking its replicas' state"
                )
        self.catch_up(tag.step, work=True)

    def vouch(self, proof: Signed | None) -> int:
        """Take note of a trainer's signed progress (refused with a ``BadInputError`` if it proves nothing)."""
        if self.proofs is None:
            raise BadInputError("this stage takes no signed steps yet")
        progress = self.proofs.progress_of(proof, dht_time())
        self.claims.note(progress.trainer, progress.step)
        return progress.step

    def note(self, trainer: str, step: int) -> None:
        """A trainer's progress record, read from the DHT (its signature and freshness checked there)."""
        self.claims.note(trainer, step)

    def reach(self, work: bool = False) -> int:
        """The furthest step the trainers' signed word lets this stage go to now (``StepClaims.reach``)."""
        return self.claims.reach(self.step, work)

    def check_step(self, step: int, work: bool = True) -> None:
        """A stage steps only as far as a trainer of the run signed, and one trainer's word moves it only so far."""
        if step <= max(self.step, self.reach(work)):
            return
        if step > self.claims.highest:
            raise BadInputError(
                f"step {step} is ahead of this stage's {self.step}, and no trainer of the run signed it"
            )
        raise BadInputError(
            f"step {step} is ahead of this stage's {self.step} by more than one trainer's word moves it "
            f"({self.claims.bound} steps); further only where two trainers of a closed run agree"
        )

    def catch_up(self, step: int, work: bool = False) -> None:
        """Take the optimizer steps the swarm has taken (none if already there), and finish the last one: as far
        as ``check_step`` lets ``step`` go (``work``: on a training request's word). A stage further behind than
        ``catch_up_limit`` (which only two trainers of a closed run agreeing can ask) skips the rest of the count,
        as it would have learnt nothing in them anyway: each step is an AdamW update on this peer's only compute
        thread."""
        self.check_step(step, work)
        if step - self.step > self.run.catch_up_limit:
            log.warning(
                "%d steps behind the swarm: skipping to step %d",
                step - self.step,
                step - 1,
                extra={"span": str(self.span)},
            )
            self.finish_step()
            self.skip_to(step - 1)
        while self.step < step:
            self.apply_step()
        self.finish_step()

    def skip_to(self, step: int) -> None:
        """Count steps without taking them (the optimizer's step counts and the schedule follow)."""
        for p in self.params:
            self.opt.state[p]["step"].fill_(float(step))
        self._begin(step)

    def _begin(self, step: int) -> None:
        """Stand at the start of ``step``: nothing accumulated, its learning rate set."""
        self.step, self.samples = step, 0
        self.by_trainer.clear()
        self.micro_seen.clear()
        self.opt.zero_grad(set_to_none=True)
        set_lr(self.opt, self.run, self.step)

    def accumulate(
        self, grads: Sequence[torch.Tensor | None], samples: int, trainer: str = "", micro: str | None = None
    ) -> None:
        """Add a micro-batch's weight gradients; with the whole global batch seen here and the next step signed,
        step now (exact for a sole replica) but leave the averaging round and checkpoint to ``finish_step``, after
        the reply: the trainer must not wait for them.

        Nothing is added from a contribution with a NaN or infinity, from one a thousand times above the bound, or
        from a trainer that already sent a whole batch for this step; one whose norm exceeds ``max_grad_norm`` per
        sample is scaled down to it (an honest one is far below: the bound stops a single request from swamping the
        step, as a loss spike would be clipped anywhere)."""
        if micro is not None and (trainer, micro) in self.micro_seen:
            return  # a micro-batch run again after a chained pass broke: its gradient is in already
        sent = self.by_trainer[trainer]
        if sent + samples > self.run.target_batch_size:
            raise BadInputError(
                f"{trainer or 'this trainer'} already sent {sent} samples of step {self.step}; a "
                f"step has {self.run.target_batch_size}"
            )
        present = [g for g in grads if g is not None]
        # One pass: in float64 the squares of any finite float32 gradient sum to a finite norm (float32's largest
        # square is about 1e77), so a norm that is not finite means a NaN or an infinity in the request.
        norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in present]
        norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        if not math.isfinite(norm):
            raise BadInputError("the weight gradient is not finite (NaN or infinite values in the request)")
        bound = self.run.max_grad_norm * max(samples, 1)
        if norm > GARBAGE * bound:  # no gradient of a model that still learns: garbage, and it changes nothing
            raise BadInputError(
                f"a gradient of norm {norm:.3g} for {samples} samples; the run bounds it at {bound:.3g}"
            )
        if norm > bound:
            self.clipped += 1
            log.warning(
                "a contribution of norm %.3g scaled down to %.3g",
                norm,
                bound,
                extra={"span": str(self.span), "session": trainer},
            )
            grads = [None if g is None else g * (bound / norm) for g in grads]
        self.by_trainer[trainer] = sent + samples
        if micro is not None:  # at most one per sample of the step, which the line above bounds
            self.micro_seen.add((trainer, micro))
        for p, g in zip(self.params, grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.samples += samples
        if self.samples >= self.run.target_batch_size and self.reach(work=True) > self.step:
            self.apply_step(finish=False)
        # Otherwise the step waits for a trainer's signature that it has begun (its next request, step notice or
        # progress): samples alone, which anyone may send under a trainer's name, never make a stage step.

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
        if self.rounds is not None:
            self.rounds.land()  # a DiLoCo round that has ended since: its outer step now, between two steps
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
        log.info("step %d applied (%d samples)", self.step + 1, self.samples, extra={"span": str(self.span)})
        if self.samples:  # stepped on samples: the stage's own evidence that the run got this far
            self.claims.reached(self.step + 1)
        self._begin(self.step + 1)
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
        if self.outer is not None:  # the round's pseudo-gradients only, each bounded as replicas' weights are
            self.averager = OwnedAverager.for_run(
                self.outer.buffers, dht, f"{prefix}_diloco", self.run, start=False, codec=self.run.sync.compression
            )
            return
        self.averager = OwnedAverager.for_run(
            self.tensors(), dht, prefix, self.run, start=False, weights=len(self.params)
        )

    def launch_averager(self) -> None:
        """From the main thread (see ``OwnedAverager.for_run``)."""
        if self.averager is not None and not self.averager.is_alive():
            self.averager.run_in_background(await_ready=True)

    @property
    def averaging_bytes(self) -> int:
        return self.averager.codec.sent if self.averager is not None else 0

    @property
    def rounds_undone(self) -> int:
        return self.health.rounds_undone

    @property
    def replica_heals(self) -> int:
        return self.health.heals

    def set_replicas(self, peer_ids: Sequence[str]) -> None:
        """The other peers holding a signed record of this stage of the run."""
        self.groupmates = frozenset(peer_ids)
        self.replicas = 1 + len(self.groupmates)

    def average(self) -> None:
        """One averaging round. Within it each part is reduced robustly (``swarm/training/robust.py``: a groupmate's
        values far from the group's are clipped), and its result is applied only when the whole round completed,
        then judged, undone or kept by ``ReplicaHealth.settle``. The state the round ended with is kept, on the
        CPU, and its digest signed, for joining replicas and exports."""
        if self.outer is not None:
            self._outer_round()
            return
        if self.averager is None or self.replicas < 2 or self.health.check(self.step, self.params):
            return  # (a replica that is off sends nothing until it has taken the others' state)
        self.averager.allow(self.groupmates)
        tensors = self.tensors()
        before = [t.clone() for t in tensors]
        if self.averager.average_round(self.run, str(self.span)) and self.health.settle(self.step, tensors, before):
            self._ended_round()

    def _outer_round(self) -> None:
        """DiLoCo's round (``peers/training/outer_rounds.py``): the replicas' pseudo-gradients averaged, robustly
        and as the run's compression sends them, while the next inner steps run; the same outer step everywhere."""
        assert self.rounds is not None
        together = self.averager is not None and self.replicas >= 2
        self.rounds.begin(self.step, self.averager if together else None, self.groupmates if together else frozenset())

    def _ended(self, step: int, outcome: Outcome) -> None:
        """Keep and sign the state a DiLoCo round ended with: the new start (as the weights) and the outer momentum,
        the same on every replica (Adam's moments are each one's own)."""
        state = {"param." + n: t.detach().cpu().clone() for n, t in zip(self.names, outcome.anchor, strict=True)}
        state |= {"outer_m." + n: t.detach().cpu().clone() for n, t in zip(self.names, outcome.momentum, strict=True)}
        self._publish_round(step, state)

    def _ended_round(self) -> None:
        """Keep (on the CPU) and sign the state the round ended with, for joining replicas and exports."""
        self._publish_round(self.step, {k: v.cpu() for k, v in self.export_state().items()})

    def _publish_round(self, step: int, state: dict[str, torch.Tensor]) -> None:
        self.last_round = (step, state)
        if self.on_round is not None:
            self.on_round(*self.last_round)

    def export_state(self, leftover: bool = False) -> dict[str, torch.Tensor]:
        """Weights and Adam's moments by their model names (copies), for a joining replica or an export; under
        DiLoCo the round's start and outer momentum too (``leftover``: and what top-k has not sent yet, for this
        peer's own checkpoints)."""
        n = len(self.params)
        tensors = self.tensors()
        state = {
            part + name: t.clone()
            for k, part in enumerate(STATE_PARTS)
            for name, t in zip(self.names, tensors[k * n : (k + 1) * n], strict=True)
        }
        if self.outer is not None:
            for part, values in self.outer.state().items():
                if part != "outer_e." or leftover:
                    state.update({part + name: t.clone() for name, t in zip(self.names, values, strict=True)})
        return state

    def import_state(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """A state by part and name. Under DiLoCo the state of a round holds only the weights and the outer
        momentum: Adam's moments then start at zero, and the round's start is the weights."""
        optional = set(STATE_PARTS[1:]) | set(OUTER_PARTS) if self.outer is not None else set()
        parts = STATE_PARTS + (OUTER_PARTS if self.outer is not None else ())
        found = parse_state(tensors, self.names, self.params, parts, optional, self.run.betas)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                state = self.opt.state[p]
                for part, target in zip(STATE_PARTS, (p.data, state["exp_avg"], state["exp_avg_sq"]), strict=True):
                    values = found[part]
                    if values is None:
                        target.zero_()
                    else:
                        target.copy_(values[i])
                state["step"].fill_(float(step))
            if self.outer is not None:
                self.outer.load({part: found[part] for part in OUTER_PARTS})
        self.claims.reached(step)  # a checkpoint of its own, or a state the replicas vouched for
        self._begin(step)
        self.health.trust(step, self.params)

    def heal(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take the replicas' state (``ReplicaHealth.wanted``; fetched and checked by the stage), then the steps
        this replica had taken since (as a replica that saw none of their micro-batches)."""
        was = self.step
        self.import_state(step, tensors)
        self.health.healed()
        log.warning("took its replicas' state of step %d (it was at %d)", step, was, extra={"span": str(self.span)})
        target = min(was, max(self.step, self.reach()))
        if target > self.step:
            self.catch_up(target)

    def rejoin(self, step: int, tensors: dict[str, torch.Tensor]) -> bool:
        """A replica the run went on without (further behind the trainers' signed step than one trainer's word moves
        it) takes its replicas' state of ``step``, fetched and believed as a joiner's is, if that is still ahead of
        it (its own steps may have moved it since the fetch began). Whether it took it."""
        if step <= self.step:
            return False
        was = self.step
        self.import_state(step, tensors)
        self.behind = 0
        log.warning("took its replicas' state of step %d: it was at %d", step, was, extra={"span": str(self.span)})
        return True

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        checkpoint = StageCheckpoint(step=self.step, span=str(self.span), tensors=self.export_state(leftover=True))
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
        if self.rounds is not None:
            self.rounds.close(self.run.averaging_timeout)
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
