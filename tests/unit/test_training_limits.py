"""What anyone can make a pre-training stage do, bounded: copies of its state (how many at once, per caller and in
all, their bytes, how often for one caller) and how far one identity's signed word moves its step. Pure logic with a
fake clock, and a real span trainer of the shipped tiny run; no network."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from peers.training.proofs import StepClaims
from peers.training.state_gate import StateCopy, StateGate
from swarm import wire
from swarm.errors import BusyError
from swarm.identity import peer_id_of_key
from swarm.protocol import StateReply
from swarm.training.run import RunConfig, load_run
from tests.helpers.runs import SHIPPED
from tests.helpers.stages import proof, stage

RUN = load_run(SHIPPED)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def copy_of(release, nbytes: int = 1000) -> StateCopy:
    return StateCopy(release, StateReply(step=3, start=0, end=2), {"param.x": torch.zeros(nbytes // 4)})


def test_state_copies_are_bounded_per_caller_in_all_and_in_bytes():
    budget = wire.ByteBudget(10_000)
    gate = StateGate(interval=30.0, clock=Clock())
    release_a = gate.admit("a", 4000, budget)
    with pytest.raises(BusyError, match="this caller holds 1 of its limit of 1"):
        gate.admit("a", 4000, budget)  # one copy at a time per caller
    release_b = gate.admit("b", 4000, budget)
    with pytest.raises(BusyError, match="limit of 2 for all callers"):
        gate.admit("c", 10, budget)  # two at a time for everyone
    assert budget.used == 8000 and gate.copies.used == 2
    release_a()
    release_a()  # giving back twice gives back once
    with pytest.raises(BusyError):
        gate.admit("c", 6001, budget)  # the server's bytes held, with the copies counted in
    assert budget.refused == 1  # refused by the byte budget, not by the gate
    assert gate.copies.used == 1 and budget.used == 4000  # a refused copy holds nothing
    release_b()
    assert budget.used == 0 and gate.copies.used == 0 and not gate.copies.held


def test_one_caller_gets_a_burst_of_copies_then_one_per_interval():
    clock = Clock()
    gate = StateGate(interval=30.0, burst=4, clock=clock)
    for _ in range(4):
        gate.admit("a", 1, None)()
    with pytest.raises(BusyError, match="one every 30 s"):
        gate.admit("a", 1, None)
    gate.admit("b", 1, None)()  # another caller has its own bucket
    clock.now += 29.0
    with pytest.raises(BusyError, match="ask again in 1.0 s"):
        gate.admit("a", 1, None)
    clock.now += 1.0
    gate.admit("a", 1, None)()
    with pytest.raises(BusyError):
        gate.admit("a", 1, None)


def test_the_buckets_of_many_callers_take_bounded_memory():
    clock = Clock()
    gate = StateGate(interval=10.0, burst=2, max_callers=3, clock=clock)
    for caller in "abc":
        gate.admit(caller, 1, None)()
    with pytest.raises(BusyError, match="3 callers asked recently"):
        gate.admit("d", 1, None)
    clock.now += 10.0  # full again: forgotten, room for others
    gate.admit("d", 1, None)()
    assert set(gate.buckets) == {"d"}


def test_a_copy_counts_until_its_frames_are_gone():
    budget = wire.ByteBudget(1 << 20)
    gate = StateGate(interval=0.0, clock=Clock())
    copy = copy_of(gate.admit("a", 1000, budget))
    frames = copy.frames(lambda reply, tensors: wire.encode(reply.model_dump(mode="json"), tensors))
    assert copy.tensors == {} and budget.used == 1000 and gate.copies.used == 1  # encoded, being sent
    del frames
    gc.collect()
    assert budget.used == 0 and gate.copies.used == 0

    def broken(reply, tensors):
        raise RuntimeError("encoding failed")

    copy = copy_of(gate.admit("a", 1000, budget))
    with pytest.raises(RuntimeError):
        copy.frames(broken)
    assert budget.used == 0 and gate.copies.used == 0


def closed(*trainers: str) -> RunConfig:
    return dataclasses.replace(RUN, trainers=trainers)


def test_one_identity_moves_a_stage_a_bounded_number_of_steps_however_often_it_asks():
    claims = StepClaims(RUN)  # an open run: anyone is a trainer, identities cost nothing
    bound = claims.bound
    claims.note("mallory", 10**12)
    assert claims.reach(0, work=False) == bound
    for k in range(20):  # more notices, from more identities: no further than its own evidence allows
        claims.note(f"sybil{k}", 10**12)
        assert claims.reach(bound, work=False) == bound
    assert claims.reach(bound, work=True) == 2 * bound  # a training request (it brings samples) from where it is
    claims.reached(bound + 1)  # a step taken on samples
    assert claims.reach(bound + 1, work=False) == 2 * bound + 1
    claims = StepClaims(RUN)
    claims.note("honest", 3)
    assert claims.reach(0, work=False) == 3  # never beyond what was signed
    assert claims.reach(5, work=False) == 5  # nor backwards


def test_a_closed_run_moves_further_only_where_two_trainers_agree():
    claims = StepClaims(closed("t1", "t2", "t3"))
    claims.note("t1", 500)
    assert claims.reach(0, work=False) == claims.bound
    claims.note("t2", 400)  # two trainers signed at least 400
    assert claims.agreed == 400 and claims.reach(0, work=False) == 400 + claims.bound
    claims.note("t2", 10**12)
    assert claims.reach(0, work=False) == 500 + claims.bound
    alone = StepClaims(closed("t1"))  # a sole listed trainer is still one identity
    alone.note("t1", 10**12)
    assert alone.agreed == 0 and alone.reach(0, work=False) == alone.bound


def test_a_self_signed_huge_notice_moves_the_stage_and_its_schedule_at_most_the_bound(tmp_path):
    t = stage(tmp_path)
    mallory = RSAPrivateKey()
    assert t.vouch(proof(10**12, mallory)) == 10**12
    t.catch_up(t.reach())  # what the stage does with the notice (``TrainableStage.step``)
    assert t.step == t.run.catch_up_limit and t.claims.highest == 10**12
    assert t.opt.param_groups[0]["lr"] == pytest.approx(t.run.lr * t.run.lr_factor(t.step))
    assert t.run.lr_factor(10**12) == 0.0 and t.opt.param_groups[0]["lr"] > 0.0  # the schedule did not end
    t.vouch(proof(10**12, RSAPrivateKey()))  # another identity: nothing more
    t.catch_up(t.reach())
    assert t.step == t.run.catch_up_limit
    assert peer_id_of_key(mallory.get_public_key().to_bytes()) not in t.claims.latest  # an open run keeps no table
