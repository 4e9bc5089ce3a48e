"""Speculative decoding through real servers (``generate(speculative=...)``): greedy tokens equal plain decoding's
and Hugging Face's with every drafter (drafts always kept, never kept, a truncated copy of the model, prompt
lookup), with a server killed by PID mid-speculation, with sessions of several threads batched on the servers, and
with verification on (no honest server blamed; a cheater caught)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.accusations import Accusations, accusations_key
from swarm.client.speculative.drafting import ModelDrafter
from swarm.client.speculative.loop import Draft, Drafter, Speculation
from swarm.rpc.evidence import facts_or_none
from tests.helpers.models import local_reference
from tests.helpers.scripts import load_script
from tests.helpers.swarms import connect, patient_timing, running_swarm, wait_for

pytestmark = pytest.mark.slow
NEW = 24


def _prompt(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 300, (14,), generator=g)
    return torch.cat([text, text[:6]]).unsqueeze(0)  # a repeat: prompt lookup finds drafts


class Contrary(Drafter):
    """Drafts the local model's least likely token, k times: every draft rejected and taken back."""

    def __init__(self, ref) -> None:
        self.ref = ref

    def propose(self, tokens, k, sampler, generator):
        with torch.no_grad():
            logits = self.ref(input_ids=torch.tensor([list(tokens)])).logits[0, -1]
        return Draft(tuple([int(logits.argmin())] * k))


class Calls(Drafter):
    """Another drafter, calling ``hook`` before its ``at``-th proposal."""

    def __init__(self, inner: Drafter, at: int, hook) -> None:
        self.inner, self.at, self.hook, self.n = inner, at, hook, 0

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, tokens, k, sampler, generator):
        self.n += 1
        if self.n == self.at:
            self.hook()
        return self.inner.propose(tokens, k, sampler, generator)


@pytest.fixture(scope="module")
def swarm3(tiny_models):
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:2", "2:4", "2:4"]) as swarm:
        yield folder, swarm


def _plain(model, ids):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False)


def test_greedy_speculation_equals_plain_decoding_with_every_drafter(swarm3, tiny_models):
    folder, swarm = swarm3
    ref = local_reference(tiny_models["llama"])
    with connect(folder, swarm, timing=patient_timing()) as model:
        same = ModelDrafter(local_reference(folder), "same")
        for seed, drafter in enumerate(["ngram", "first:1", same, Contrary(ref)]):
            ids = _prompt(seed)
            want = ref.generate(ids, max_new_tokens=NEW, do_sample=False)
            assert torch.equal(_plain(model, ids), want)
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative=Speculation(drafter, k=4))
            assert torch.equal(got, want), drafter
            trace = model.last_speculation
            if isinstance(drafter, ModelDrafter):  # the same weights: drafts kept, several tokens a trip
                assert trace.kept > trace.drafted // 2 and trace.trips < NEW // 2
            if isinstance(drafter, Contrary):  # every trip took its drafts back
                assert trace.kept == 0 and trace.trips == NEW - 1 and trace.ks[:10] == [4] * 10
        # a conversation continued in an open session, speculative then plain, as plain all along
        ids, more = _prompt(7), _prompt(8)[:, :5]
        with model.inference_session(max_length=128):
            first = model.generate(ids, max_new_tokens=10, do_sample=False, speculative="ngram")
            second = model.generate(more, max_new_tokens=10, do_sample=False)
        want = ref.generate(ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(first, want)
        want2 = ref.generate(torch.cat([want, more], dim=1), max_new_tokens=10, do_sample=False)
        assert torch.equal(second, want2)
    # the client's own first block (local_blocks) drops its rejected drafts as the servers do
    with connect(folder, swarm, timing=patient_timing(), local_blocks=1) as model:
        ids = _prompt(9)
        got = model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative=Speculation(Contrary(ref), k=3))
        assert torch.equal(got, ref.generate(ids, max_new_tokens=NEW, do_sample=False))
        assert model.last_speculation.drafted > 0 and model.last_speculation.kept == 0


def test_server_killed_mid_speculation_loses_no_token(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    with running_swarm(folder, ["0:2", "2:4", "2:4"]) as swarm:
        with connect(folder, swarm, timing=patient_timing()) as model:
            killed: list[str] = []

            def kill() -> None:  # the session's 2:4 server, by PID, between two speculative trips
                victim = next(p for p in swarm.peers[1:] if p.peer_id in {h.peer_id for h in model.route})
                killed.append(victim.peer_id)
                swarm.kill(victim)

            ids = _prompt(3)
            drafter = Calls(ModelDrafter(local_reference(folder), "same"), 3, kill)
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative=Speculation(drafter, k=3))
            assert killed and model.failovers >= 1
            assert killed[0] not in {h.peer_id for h in model.route}
            assert torch.equal(got, ref.generate(ids, max_new_tokens=NEW, do_sample=False))


def test_speculative_sessions_of_several_threads_batch_and_match(swarm3, tiny_models):
    folder, swarm = swarm3
    ref = local_reference(tiny_models["llama"])
    with connect(folder, swarm, timing=patient_timing()) as model:
        start = threading.Barrier(4)

        def job(i: int) -> torch.Tensor:
            start.wait(60)
            return model.generate(_prompt(20 + i), max_new_tokens=NEW, do_sample=False, speculative="ngram")

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(job, range(4)))
    for i, out in enumerate(outs):
        assert torch.equal(out, ref.generate(_prompt(20 + i), max_new_tokens=NEW, do_sample=False)), i


def test_verification_with_speculation_blames_no_honest_server(swarm3, tiny_models):
    folder, swarm = swarm3
    ref = local_reference(tiny_models["llama"])
    with connect(folder, swarm, timing=patient_timing(), verify_every=2, verify_seed=4) as model:
        wait_for(lambda: len(model.connection.view.servers()) == 3, 60, "every server in the client's view")
        ids = _prompt(5)
        with model.inference_session(max_length=80) as session:
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative=Speculation("ngram", k=3))
        assert torch.equal(got, ref.generate(ids, max_new_tokens=NEW, do_sample=False))
        stats = session.verifier.stats
        assert stats.outcomes["ok"] >= 2 and set(stats.outcomes) <= {"ok", "unverifiable"}
        assert session.caught == [] and not model.connection.view.banned()


def test_cheater_caught_while_speculating(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    cheaters = load_script("cheating_server")
    with running_swarm(folder, ["0:4", "0:4"]) as swarm:
        cheater = cheaters.start_cheater(swarm, "quant4", "0:4").peer_id
        with connect(folder, swarm, timing=patient_timing(), verify_every=4, verify_seed=1) as model:
            wait_for(lambda: len(model.connection.view.servers()) == 3, 60, "every server in the client's view")
            ids = _prompt(6)
            drafter = ModelDrafter(local_reference(folder), "same")
            with model.inference_session(max_length=80) as session:
                model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative=Speculation(drafter, k=3))
            assert cheater in session.caught and cheater in model.connection.view.banned()
            # accused in the DHT with evidence anyone can check (signed steps whose rejected drafts ride as tails)
            conn = model.connection
            records = conn.store.read(accusations_key(conn.model_id), Accusations)
            mine = [r for r in records if r.accuser == conn.peer_id]
            assert mine and [a.accused for a in mine[0].items] == [cheater]
            facts, why = facts_or_none(mine[0].items[0].evidence, cheater, 0, 4)
            assert facts is not None, why
            ids = _prompt(9)  # afterwards, honest servers only
            got = model.generate(ids, max_new_tokens=8, do_sample=False, speculative="ngram")
            assert torch.equal(got, ref.generate(ids, max_new_tokens=8, do_sample=False))
