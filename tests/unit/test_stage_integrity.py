"""A pre-training stage takes nothing on anyone's word: steps at most one ahead unless a trainer of the run signed
them, gradients finite and bounded, samples counted per trainer, states finite; a joiner believes a replica's state
only as the replicas signed it. Real span trainers over the shipped tiny run, no network."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from peers.training.span_trainer import SpanTrainer
from swarm.errors import BadInputError, BusyError, StaleStepError
from swarm.identity import Signed, peer_id_of_key
from swarm.protocol import StateReply, TrainTag
from swarm.records import RoundRecord, ServerRecord
from swarm.training.checkpoints import state_digest
from swarm.training.state import StageSources, stage_state
from tests.helpers.records import record
from tests.helpers.stages import KEY, STAGE, proof, stage

STRANGER = RSAPrivateKey()
TRAINER = peer_id_of_key(KEY.get_public_key().to_bytes())


def tag(step: int, signed: Signed | None = None, trainer: str = TRAINER) -> TrainTag:
    return TrainTag(step=step, samples=8, trainer=trainer, proof=signed)


def grads(trainer: SpanTrainer, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(p.shape, generator=gen) * scale for p in trainer.params]


def weights(trainer: SpanTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def test_a_stage_steps_only_as_far_as_a_trainer_signed_and_never_spins(tmp_path):
    t = stage(tmp_path)
    t.admit(tag(0))  # the stage's own step: nothing to prove
    with pytest.raises(BadInputError, match="signed progress of a trainer"):
        t.admit(tag(1))
    with pytest.raises(BadInputError, match="signature does not match"):
        forged = proof(1).model_copy(update={"payload": proof(1).payload.replace('"step":1', '"step":9')})
        t.admit(tag(9, forged))
    with pytest.raises(BadInputError, match="stale"):
        t.admit(tag(1, proof(1, age=120.0)))
    with pytest.raises(BadInputError, match="no trainer of the run signed"):
        t.admit(tag(3, proof(2)))  # a proof of step 2 vouches for no step beyond it
    assert t.step == 0
    t.admit(tag(1, proof(1)))  # one ahead, signed: the normal case between batches
    assert t.step == 1
    with pytest.raises(BadInputError, match="no trainer of the run signed"):
        t.catch_up(5)
    limit = t.run.catch_up_limit
    t.admit(tag(1 + limit, proof(1 + limit)))  # a training request moves it at most that far past its step
    assert t.step == 1 + limit
    with pytest.raises(BusyError, match="taking its replicas' state"):
        t.admit(tag(10**12, proof(10**12)))  # far ahead, signed by one trainer: refused, nothing moves
    assert t.step == 1 + limit and all(t.opt.state[p]["step"].item() == 1 + limit for p in t.params)
    assert t.behind == 10**12  # what the follow loop then does: ask its replicas for a state ahead (``rejoin``)
    t.catch_up(t.reach())  # what a step notice of 10^12 does: nothing more, none of these steps had samples
    assert t.step == 1 + limit
    with pytest.raises(StaleStepError):
        t.admit(tag(0))


def test_a_replica_the_run_left_behind_refuses_busy_and_takes_only_a_state_ahead_of_it(tmp_path):
    """Stop 67's trap: a replica further behind the trainer's signed step than one trainer's word moves it refused
    every request as bad input, for good. Now it says busy (the trainer goes to another replica, and comes back) and
    takes its replicas' state when one ahead of it is found; a state not ahead of it (its own steps moved it since
    the fetch began, or the word was a lie) changes nothing."""
    ahead, behind = stage(tmp_path / "a"), stage(tmp_path / "b")
    far = 2 * behind.run.catch_up_limit
    for step in range(1, far + 1):  # the replica the trainer went on with, stepping on samples
        ahead.admit(tag(step, proof(step)))
        ahead.accumulate(grads(ahead), 8, TRAINER)
    ahead.admit(tag(far + 1, proof(far + 1)))
    assert ahead.step == far + 1
    with pytest.raises(BusyError, match="behind the trainer"):
        behind.admit(tag(far + 1, proof(far + 1)))
    assert behind.step == 0 and behind.behind == far + 1
    assert not behind.rejoin(0, behind.export_state())  # not ahead of it: nothing changes
    assert behind.rejoin(ahead.step, ahead.export_state())
    assert behind.step == far + 1 and behind.behind == 0 and weights(behind)[0].equal(weights(ahead)[0])
    behind.admit(tag(far + 1, proof(far + 1)))  # and it takes the trainer's requests again
    assert not behind.rejoin(3, ahead.export_state())  # a state behind it is never taken


def test_a_closed_run_admits_only_its_trainers(tmp_path):
    t = stage(tmp_path, trainers=(TRAINER,))
    t.admit(tag(0))
    with pytest.raises(BadInputError, match="not a trainer of run"):
        t.admit(tag(0, trainer="QmStranger"))
    with pytest.raises(BadInputError, match="not a trainer of run"):  # a stranger's own signature proves nothing
        t.admit(tag(1, proof(1, STRANGER)))
    with pytest.raises(BadInputError, match="signed by"):  # nor does it, in the trainer's name
        t.admit(tag(1, proof(1, STRANGER, trainer=TRAINER)))
    assert t.step == 0
    t.admit(tag(1, proof(1)))
    assert t.step == 1


def test_non_finite_gradients_change_nothing_and_huge_ones_are_bounded(tmp_path):
    t = stage(tmp_path)
    before = weights(t)
    poisoned = grads(t)
    poisoned[3][0, 0] = float("nan")
    with pytest.raises(BadInputError, match="not finite"):
        t.accumulate(poisoned, 16, "a")
    assert t.samples == 0 and all(p.grad is None for p in t.params)
    with pytest.raises(BadInputError, match="the run bounds it"):  # garbage: refused outright
        t.accumulate(grads(t, 1e30), 8, "a")
    assert all(p.grad is None for p in t.params)
    huge = grads(t, 100.0)  # far above an honest gradient, within reach of a loss spike: scaled down
    t.accumulate(huge, 8, "a")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in t.params]))
    assert t.clipped == 1 and float(norm) == pytest.approx(t.run.max_grad_norm * 8, rel=1e-4)
    t.accumulate(grads(t), 8, "b")  # the batch is complete, but nobody signed that step 1 began: no step yet
    assert t.step == 0 and t.samples == 16
    t.admit(tag(1, proof(1)))  # the trainer's next request, signed: the step is taken first
    assert t.step == 1
    assert all(torch.isfinite(p).all() for p in t.params)
    assert any(not torch.equal(a, p) for a, p in zip(before, t.params, strict=True))


def test_one_trainer_cannot_fill_a_step_twice(tmp_path):
    t = stage(tmp_path, target_batch_size=32)
    t.accumulate(grads(t), 8, "a")
    with pytest.raises(BadInputError, match="already sent 8 samples"):
        t.accumulate(grads(t), 32, "a")
    t.vouch(proof(1))  # the trainer already signed step 1 (a replica that saw the rest of the batch elsewhere)
    t.accumulate(grads(t), 24, "b")
    assert t.step == 1 and not t.by_trainer  # counted afresh for the next step


def test_a_state_with_nan_is_refused(tmp_path):
    t = stage(tmp_path)
    state = t.export_state()
    next(iter(state.values()))[0] = float("inf")
    with pytest.raises(BadInputError, match="NaN or infinite"):
        t.import_state(3, state)
    assert t.step == 0


class FakeRemote:
    """Replicas answering state requests from a table (the selection logic is what is under test)."""

    def __init__(
        self,
        states: dict[str, tuple[int, dict[str, torch.Tensor]]],
        rounds: dict[str, tuple[int, dict[str, torch.Tensor]]],
        torn: frozenset[str] = frozenset(),
    ) -> None:
        """``torn``: replicas whose current state changed after they hashed it (the digest sent is of another)."""
        self.states, self.rounds, self.torn = states, rounds, torn

    async def state(self, hop, timeout, max_bytes, last_round=False):
        step, tensors = (self.rounds if last_round else self.states)[hop.peer_id]
        if last_round:  # a round's state is checked against the replica's signed round record
            return StateReply(step=step, start=STAGE.start, end=STAGE.end), tensors
        hashed = {k: v + 1 for k, v in tensors.items()} if hop.peer_id in self.torn else tensors
        return StateReply(step=step, start=STAGE.start, end=STAGE.end, digest=state_digest(hashed)), tensors


def server(peer_id: str) -> ServerRecord:
    return record(peer_id=peer_id, start=STAGE.start, end=STAGE.end, num_blocks=6)


def round_of(peer_id: str, step: int, tensors: dict[str, torch.Tensor]) -> RoundRecord:
    return RoundRecord(
        peer_id=peer_id, start=STAGE.start, end=STAGE.end, step=step, digest=state_digest(tensors), updated=0.0
    )


def run_selection(remote: FakeRemote, sources: StageSources):
    import asyncio

    return asyncio.run(stage_state(remote, sources, STAGE, 1.0, 1 << 30))  # type: ignore[arg-type]


def test_a_joiner_takes_the_round_two_replicas_sign_not_the_furthest_claim():
    honest = {"w": torch.ones(4)}
    nearly = {"w": torch.ones(4) + 1e-7}  # another replica after the same all-reduce: equal up to rounding
    garbage = {"w": torch.full((4,), 1e6)}
    remote = FakeRemote(
        states={"A": (12, honest), "B": (12, nearly), "E": (11, garbage)},
        rounds={"A": (10, honest), "B": (10, nearly), "E": (10, garbage)},
    )
    rounds = [
        round_of("A", 10, honest),
        round_of("B", 10, nearly),
        round_of("E", 10, garbage),
        round_of("E", 11, garbage),
    ]
    sources = StageSources([server("E"), server("A"), server("B")], rounds, max_step=13)
    step, state = run_selection(remote, sources)
    assert step == 10 and (torch.equal(state["w"], honest["w"]) or torch.equal(state["w"], nearly["w"]))
    # a replica that serves something else than it signed is not believed
    lying = FakeRemote(states=remote.states, rounds={"A": (10, honest), "B": (10, garbage), "E": (10, garbage)})
    signed = [round_of("A", 10, honest), round_of("B", 10, nearly), round_of("E", 10, honest)]
    assert run_selection(lying, StageSources([server("A"), server("B"), server("E")], signed, 13)) is None


def test_without_rounds_a_joiner_takes_the_furthest_state_a_trainer_vouches_for():
    a, b = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    remote = FakeRemote(states={"A": (7, a), "E": (10**9, b)}, rounds={})
    step, state = run_selection(remote, StageSources([server("A"), server("E")], [], max_step=8))
    assert step == 7 and torch.equal(state["w"], a["w"])
    assert run_selection(remote, StageSources([server("E")], [], max_step=8)) is None


def test_a_state_copy_is_believed_only_as_the_replica_hashed_it_at_the_step_it_names():
    """A copy that changed between the replica's hash and its arrival (a torn copy, a step applied half-way through
    it) is not taken; the next replica's is."""
    a, b = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    remote = FakeRemote(states={"A": (7, a), "B": (6, b)}, rounds={}, torn=frozenset({"A"}))
    step, state = run_selection(remote, StageSources([server("A"), server("B")], [], max_step=8))
    assert step == 6 and torch.equal(state["w"], b["w"])
    assert run_selection(remote, StageSources([server("A")], [], max_step=8)) is None
