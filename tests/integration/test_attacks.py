"""Attacks by a real malicious process (``tests/helpers/attacker.py``: its own identity, DHT peer and RPC calls
on loopback) on real swarms. Every attack fails: honest clients get the outputs of a local Hugging Face run, the
swarm keeps its coverage, the servers stay up, and a pre-training run learns exactly what it learns alone."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.config import Timing
from swarm.dht import RecordStore, current_broker, dht_time, load_identity, start_dht
from swarm.identity import peer_id_of_key
from swarm.ids import assignment_key
from swarm.records import Assignment, PeerState, servers
from tests.helpers import swarms
from tests.helpers.models import local_reference
from tests.helpers.swarms import patient_timing, running_swarm, scrape, wait_for

# The fast subset keeps the attack on a closed pre-training run (it checks the training too); the full suite runs
# every one.
TIMING = Timing.for_tests()


ROOT = Path(__file__).parents[2]


ATTACKER = "tests.helpers.attacker"


def _command(kind: str, swarm: Any, model_id: str, num_blocks: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        ATTACKER,
        kind,
        "--initial-peers",
        *swarm.initial_peers,
        "--model-id",
        model_id,
        "--num-blocks",
        str(num_blocks),
        *extra,
    ]


def attack(kind: str, swarm: Any, model_id: str, num_blocks: int, *extra: str, timeout: float = 120) -> dict:
    """Run one attack to its end, in a process forked from the session's fork server (its imports are the peers');
    its JSON report."""
    with tempfile.TemporaryDirectory(prefix="swarm-attacker-") as folder:
        log = Path(folder) / f"{kind}.log"
        argv = _command(kind, swarm, model_id, num_blocks, *extra)[3:]
        process = swarms.SPAWNERS[0].spawn(argv, log, main=ATTACKER)
        try:
            code = process.wait(timeout)
        finally:
            process.kill()  # by its PID, if it outlived the timeout
        assert code == 0, log.read_text()[-3000:]
        return json.loads(log.with_suffix(".out").read_text().strip().splitlines()[-1])


class Attacker:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def stop(self) -> None:
        """Tell it to stop (an attack that reads stdin for that) and write its report."""
        assert self.process.stdin is not None
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()

    def report(self, timeout: float = 60) -> dict:
        """Its JSON report, once it ends."""
        out, _ = self.process.communicate(timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def attacking(kind: str, swarm: Any, model_id: str, num_blocks: int, *extra: str) -> Iterator[Attacker]:
    """An attack running in the background while the test drives the swarm; killed if the test ends first."""
    process = subprocess.Popen(
        _command(kind, swarm, model_id, num_blocks, *extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        yield Attacker(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def pushing_passes(swarm: Any, model_id: str, honest: str, control: Path) -> Iterator[Callable[[], dict]]:
    """The pass-push attack (``tests/helpers/attacker_passes.py``) in the background, forked like ``attack``'s,
    driven by files in ``control``; yields a reader of its next JSON line. Killed if the test ends first."""
    argv = _command("passes", swarm, model_id, 6, "--honest", honest, "--control", str(control), "--seconds", "300")
    log = control / "passes.log"
    process = swarms.SPAWNERS[0].spawn(argv[3:], log, main=ATTACKER)
    assert process.stdout is not None
    lines = iter(process.stdout)

    def said() -> dict:
        line = next(lines, None)
        assert line is not None, log.read_text()[-3000:]  # it ended without saying it
        return json.loads(line)

    try:
        yield said
        assert process.wait(60) == 0, log.read_text()[-3000:]
    finally:
        process.kill()  # by its PID, if it outlived the test


def pass_pushes(peer: Any) -> tuple[dict[str, float], float]:
    """A server's count of the pass pushes it got, by outcome, and the most one pusher held there at once."""
    got = scrape(peer.urls["metrics"])
    outcomes = {dict(k[1])["outcome"]: v for k, v in got.items() if k[0] == "swarm_peer_pass_pushes_total"}
    return outcomes, got[("swarm_peer_pass_push_early_peak", ())]


def roles(store: RecordStore, model: str, num_blocks: int) -> dict[str, tuple[str, int, int]]:
    return {r.peer_id: (r.state.value, r.start, r.end) for r in servers(store.view(model, num_blocks)).values()}


def replicated(store: RecordStore, model: str, num_blocks: int, copies: int) -> bool:
    view = store.view(model, num_blocks)
    return all(sum(r.state == PeerState.ONLINE for r in view[b]) >= copies for b in range(num_blocks))


def rounds_since(store: RecordStore, model: str, broker: str, peers: list[str], since: float, rounds: int = 2) -> None:
    """Wait until ``broker`` has made ``rounds`` plans after ``since`` (their own DHT times), and every one of ``peers``
    has sent a heartbeat after the last: rounds in which anything the records changed would have shown."""
    for _ in range(rounds):
        since = wait_for(
            lambda t=since: max(
                (
                    a.issued_at
                    for a in store.read(assignment_key(model), Assignment)
                    if a.broker == broker and a.issued_at > t
                ),
                default=None,
            ),
            60,
            "a newer plan of the broker",
        )
    beats = lambda: {r.peer_id: r.updated_at for r in store.heartbeats(model)}  # noqa: E731
    wait_for(lambda: all(beats().get(p, 0.0) > since for p in peers), 60, "every peer's heartbeat since")


@pytest.mark.slow
def test_forged_records_a_fake_broker_and_a_seized_broker_change_nothing(tiny_models):
    from swarm import DistributedModelForCausalLM

    folder = tiny_models["llama"]
    model = Path(folder).resolve().name
    ref = local_reference(folder)
    ids = torch.randint(0, 320, (1, 6), generator=torch.Generator().manual_seed(5))
    expected = ref.generate(ids, max_new_tokens=16, do_sample=False)
    policy = ("--max-blocks", "2", "--standby-fraction", "0", "--replication", "2")
    with running_swarm(str(folder), [None], *policy) as swarm:  # the one honest broker candidate
        for _ in range(3):
            swarm.add_peer(None, *policy, "--no-broker")
        honest = [p.peer_id for p in swarm.peers]
        store = start_dht(initial_peers=tuple(swarm.initial_peers), client_mode=True)
        try:
            wait_for(lambda: replicated(store, model, 4, 2), 60, "every block on two peers")
            before = roles(store, model, 4)
            lease = wait_for(lambda: current_broker(store, model, TIMING), 20, "a broker")
            assert lease.holder == honest[0]

            # 1. forged, foreign-key and shadowing records, fake leases and assignments, a malformed lease, a
            #    heartbeat dated in the future
            done = attack("records", swarm, model, 4)
            ended = dht_time()
            stored = (
                "unsigned",
                "own_weights",
                "shadow",
                "huge_lease",
                "next_term_lease",
                "foreign_assignment",
                "owner_confusion",
                "malformed_lease",
                "future_heartbeat",
            )
            assert all(done[k] for k in stored), done
            second, third = done["sybils"]
            rounds_since(store, model, honest[0], honest, ended)  # rounds of the broker and every follower since
            # a newcomer (no lease obeyed yet) follows the highest live term, so the attack's one-shot claims of
            # higher terms fool it until they lapse (the peers that obeyed the honest broker never followed them: no
            # pre-emption, checked below); how quickly the rounds above come decides nothing once they have lapsed
            wait_for(lambda: dht_time() > ended + TIMING.lease_seconds + 0.5, 30, "the attack's claims to lapse")
            # the attacker's own record (signed, of weights nobody holds) is there to read; the honest peers are
            # where they were
            now = roles(store, model, 4)
            assert now[second][2] == 4 and {p: now[p] for p in before} == before
            assert current_broker(store, model, TIMING).holder == honest[0]
            obeyed = [a for a in store.read(assignment_key(model), Assignment) if a.broker == honest[0]]
            assert obeyed and all(third not in a.placements for a in obeyed)  # its future heartbeat was refused
            assert store.dropped["unsigned"] and store.dropped["foreign"] and store.dropped["malformed"]
            with DistributedModelForCausalLM.from_pretrained(  # patient: only a forged record can make it fail over
                folder, initial_peers=swarm.initial_peers, timing=patient_timing(), verify_every=0
            ) as client:
                assert torch.equal(client.generate(ids, max_new_tokens=16, do_sample=False), expected)
                assert client.failovers == 0  # no forged record was ever on its route
                assert {h.peer_id for h in client.route} <= set(honest)

            # 2. the honest broker dies (once the attacker watches its lease, as every follower does); the attacker
            #    is the only candidate left, takes the lease, and orders plans that would uncover blocks: the
            #    followers refuse them
            with attacking("broker", swarm, model, 4, "--seconds", "300") as attacker:  # until told to stop
                stdout = attacker.process.stdout
                assert stdout is not None and stdout.readline().strip() == "ready"
                swarm.kill(swarm.peer_by_id(honest[0]))
                seized = wait_for(
                    lambda: (b := current_broker(store, model, TIMING)) and b.holder != honest[0] and b,
                    60,
                    "the attacker to hold the lease",
                )
                # five of its plans, and every survivor's heartbeat since: rounds in which they could have obeyed
                rounds_since(store, model, seized.holder, honest[1:], seized.start, rounds=5)
                attacker.stop()
                result = attacker.report()
            assert seized.holder == result["attacker"] and result["plans"] >= 5
            survivors = {p: v for p, v in before.items() if p != honest[0]}
            assert {p: v for p, v in roles(store, model, 4).items() if p in survivors} == survivors
            assert replicated(store, model, 4, 1)
            assert all(swarm.peer_by_id(p).proc.poll() is None for p in honest[1:])
            with DistributedModelForCausalLM.from_pretrained(
                folder, initial_peers=swarm.initial_peers, timing=TIMING, verify_every=0
            ) as client:
                assert torch.equal(client.generate(ids, max_new_tokens=16, do_sample=False), expected)
        finally:
            store.shutdown()


def closed_run(tmp_path: Path, *identities: Path, **sections: Any) -> Path:
    from tests.helpers.runs import write_run

    trainers = [peer_id_of_key(load_identity(i).get_public_key().to_bytes()) for i in identities]
    return write_run(tmp_path, trust={"trainers": trainers}, **sections)


def test_poisoned_training_requests_forged_steps_and_progress_change_nothing(tmp_path):
    """A closed run (the run lists its trainers): the attacker's backward passes with NaN, overflowing or
    miscounted gradients, its requests as a stranger, its steps far ahead, its step notices and progress records
    (its own and forged in the trainer's name) are all refused or ignored; its flood of state requests from three
    identities is refused as ``busy`` beyond the stage's limits; and the run's losses are exactly those of the
    same training in one process, its last steps run while another attacker identity, which announces a record of
    the block before the second stage, pushes passes nobody asked for under made-up trainer names: the stage keeps
    at most that identity's share of them, and none from an identity without such a record. Then a second listed
    trainer gone rogue signs step notices of step 10^12: each stage moves at most ``catch_up_limit`` steps, its
    schedule far from its end, and still answers."""
    from peers.rpc.passes import MAX_EARLY_PER_PUSHER
    from peers.training.state_gate import BURST
    from swarm.client.training.local import LocalTraining
    from swarm.client.training.trainer import Trainer
    from swarm.errors import BusyError
    from swarm.training.data import Samples, corpus_files, tokenize
    from swarm.training.run import load_run
    from tests.helpers.runs import close_all, stage_state

    identity, rogue = tmp_path / "trainer.key", tmp_path / "rogue.key"
    run_file = closed_run(tmp_path, identity, rogue, checkpoint={"every_steps": 0}, averaging={"every_steps": 0})
    run = load_run(run_file)
    data = Samples(tokenize(corpus_files(None), "bytes", 256), run.seq_len, run.seed)
    local = LocalTraining(run, data)
    expected = [local.train_step() for _ in range(8)]
    interval = 60.0  # test timings turn the per-caller rate of state copies off: on here, longer than the test
    args = ("--train", str(run_file), "--state-interval", str(interval), "--metrics-port", "0")
    with running_swarm("tiny-llama", [str(s) for s in run.stages], *args) as swarm:
        with Trainer(run, data, tuple(swarm.initial_peers), timing=TIMING, identity=identity) as trainer:
            losses = [trainer.train_step() for _ in range(4)]
            done = attack(
                "training",
                swarm,
                run.model_id,
                6,
                "--honest",
                trainer.trainer_id,
                "--trainers-key",
                run.trainers_key,
                "--step",
                str(trainer.step),
            )
            control = tmp_path / "passes"
            control.mkdir()
            target = next(p for p in swarm.peers if p.span != str(run.stages[0]))  # the stage a pass pushes to
            before, _ = pass_pushes(target)
            with pushing_passes(swarm, run.model_id, trainer.trainer_id, control) as said:
                first = said()  # the identity without a record pushed
                assert first["target"] == target.peer_id
                refused = lambda: pass_pushes(target)[0].get("no_record", 0) - before.get("no_record", 0)  # noqa: E731
                wait_for(lambda: refused() >= first["stranger"], 60, "the pushes without a record refused")
                assert refused() == first["stranger"] and pass_pushes(target)[0].get("kept") == before.get("kept")
                (control / "go").touch()
                said()  # the identity with a record pushes twice its share every second from now on
                wait_for(lambda: pass_pushes(target)[0].get("share", 0) > 0, 60, "pushes beyond its share refused")
                losses += [trainer.train_step() for _ in range(4)]
                (control / "stop").touch()
                report = said()
            outcomes, peak = pass_pushes(target)
            print(f"the second stage's pass pushes: {outcomes}, at most {peak} of one pusher; the attacker's: {report}")
            assert peak == MAX_EARLY_PER_PUSHER, (peak, outcomes)  # its share, whatever trainer names it wrote
            assert report["sent"] >= 2 * MAX_EARLY_PER_PUSHER and outcomes["share"] > 0, (report, outcomes)
            assert "full" not in outcomes and "busy" not in outcomes, outcomes  # the room of all pushers never filled
            assert outcomes.get("taken", 0) > before.get("taken", 0), outcomes  # the honest passes went on beside it
            answers = done["answers"]
            assert answers["stranger"].startswith("BadInputError") and "not a trainer" in answers["stranger"]
            # in the honest trainer's name: both planes know who calls, so a borrowed name is refused outright
            # (NaN and overflowing gradients of a trainer of its own are refused too: tests/unit/test_stage_integrity)
            borrowed = f"in the name of trainer {trainer.trainer_id} must come from it"
            for name in ("nan", "overflow", "miscount", "backward overflow", "far ahead", "forged proof"):
                assert borrowed in answers[name], (name, answers[name])
            assert "NaN" in answers["backward nan"]
            assert "claims 16 samples but holds 8" in answers["backward miscount"]
            assert "not a trainer" in answers["notice"] and "signed by" in answers["notice forged"]
            # the flood: each identity is refused as busy within its burst (plus one a state_interval, however slow
            # the machine), before anything is copied
            allowed = BURST + int(done["flood_seconds"] / interval) + 1
            for who, got in done["flood"].items():
                assert got[-1].startswith("BusyError") and len(got) <= allowed + 1, (who, got)
                assert all(a == "ok" for a in got[:-1]), (who, got)
            assert all(swarm.peer_by_id(p.peer_id).proc.poll() is None for p in swarm.peers)
            assert trainer.step == 8
            assert close_all(losses, expected), (losses, expected)

            # a listed trainer gone rogue: its self-signed notices of step 10^12 move each stage a bounded distance
            rogue_done = attack("notice", swarm, run.model_id, 6, "--identity", str(rogue))
            assert all(a == "ok" for got in rogue_done["answers"].values() for a in got), rogue_done
            for p in swarm.peers:
                stage = next(s for s in run.stages if str(s) == p.span)

                def read(peer_id=p.peer_id, stage=stage):  # an honest export's read: the trainer has its own bucket
                    try:
                        return stage_state(trainer, peer_id, stage)
                    except BusyError:
                        return None

                step, weights = wait_for(read, 30, "the stage's state")
                assert 8 <= step <= 8 + run.catch_up_limit, (p.span, step)
                assert run.lr_factor(step) > 0.5 and all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_an_outsider_cannot_join_the_replicas_averaging(tmp_path):
    """The attacker runs hivemind's averager under the replicas' group prefix with garbage of the right shapes, until
    it got into two of their groups: the replicas leave each, their weights never see its values, and it completes
    no round."""
    from peers.training.span_trainer import SpanTrainer
    from swarm.client.training.trainer import Trainer
    from swarm.model_files import new_model
    from swarm.training.data import Samples, corpus_files, tokenize
    from swarm.training.run import load_run
    from tests.helpers.runs import stage_state, write_run

    run_file = write_run(
        tmp_path,
        stages={"spans": ["0:3", "3:6"]},
        checkpoint={"every_steps": 0},
        averaging={"every_steps": 1, "matchmaking_seconds": 1.0},
    )
    run = load_run(run_file)
    stage = run.stages[0]
    layers = torch.nn.ModuleList(new_model(run.hf_config(), torch.float32).model.layers[stage.start : stage.end])
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([list(t.shape) for t in SpanTrainer(run, layers, stage, tmp_path).tensors()]))
    prefix = f"{run.model_id}_stage{stage.start}-{stage.end}".replace(".", "_")
    data = Samples(tokenize(corpus_files(None), "bytes", 256), run.seq_len, run.seed)
    with running_swarm("tiny-llama", ["0:3", "0:3", "3:6"], "--train", str(run_file)) as swarm:
        extra = ("--prefix", prefix, "--shapes", str(shapes), "--seconds", "120", "--groups", "2")
        with attacking("averaging", swarm, run.model_id, 6, *extra) as attacker:
            with Trainer(run, data, tuple(swarm.initial_peers), timing=TIMING) as trainer:
                losses = []
                while attacker.process.poll() is None:  # a step and an averaging round, until it got into two groups
                    losses.append(trainer.train_step())
                replicas = [p.peer_id for p in swarm.peers if p.span == "0:3"]
                for peer_id in replicas:
                    _, weights = stage_state(trainer, peer_id, stage)
                    assert all(torch.isfinite(w).all() and w.abs().max() < 100 for w in weights.values())
            result = attacker.report()
    assert result["groups"] >= 1 and result["rounds"] == 0  # it did get into the replicas' groups; they left
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
