"""The parts of verification that need no swarm: the comparison rule against real blocks' numerics and real
cheats, the schedule of checks, and evidence built from a real commitment signer, which checks only when every
signature, digest and piece of the context binds the accused."""

from __future__ import annotations

import random

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm.accusations import Accusation, Accusations, Evidence, Piece, TensorBlob
from swarm.errors import BadInputError
from swarm.identity import Credentials
from swarm.protocol import StepReply
from swarm.records import ServerRecord
from swarm.rpc.commit import CommitSigner, binding
from swarm.rpc.evidence import build, check
from swarm.rpc.judging import MAX_ATTEMPTS, RETRY_AFTER, VOUCH_WINDOWS, Conviction, Docket, judge
from swarm.verdict import FLOAT32, HALF, Gaps, compare, tolerance
from tests.helpers.records import record


def _block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def test_the_rule_passes_honest_rounding_and_fails_each_cheat():
    block = _block()
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    honest = x + block(x)
    # float32 arithmetic in another order (a prefill against single steps): within the float32 tolerance
    steps = torch.cat([x[:, i : i + 1] + block(x[:, i : i + 1]) for i in range(24)], dim=1)
    assert compare(steps, honest).within(FLOAT32)
    # bfloat16 weights and activations against float32: outside float32's tolerance, inside the half one
    half = x.bfloat16() + _block().bfloat16()(x.bfloat16())
    assert not compare(half, honest).within(FLOAT32) and compare(half, honest).within(HALF)
    assert tolerance("float32", "bfloat16") == HALF and tolerance("float32") == FLOAT32
    rms = honest.pow(2).mean(-1, keepdim=True).sqrt()
    noise = honest + 1e-2 * rms * torch.randn(honest.shape, generator=torch.Generator().manual_seed(2))
    assert not compare(noise, honest).within(FLOAT32)
    one = honest.clone()  # noise on one step of a long window: diluted in the rms, caught at its position
    one[:, 7] = noise[:, 7]
    assert compare(one, honest).rms < FLOAT32.rms and not compare(one, honest).within(FLOAT32)
    last = honest.clone()
    last[:, -1] = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)) * rms[:, -1]
    found = compare(last, honest)
    assert not found.within(HALF) and found.worst_position == 23
    other = x + _block(5)(x)  # another block's weights
    assert not compare(other, honest).within(HALF)
    nan = honest.clone()
    nan[0, 3, 4] = float("nan")
    assert not compare(nan, honest).within(HALF) and "non-finite" in compare(nan, honest).describe()


def test_windows_close_at_random_within_twice_the_mean():
    draws = [Gaps(16, random.Random(s)).draw() for s in range(2000)]
    assert min(draws) == 1 and max(draws) == 31 and 15 < sum(draws) / len(draws) < 17
    assert Gaps(0, random.Random(0)).draw() > 1 << 60  # off


@pytest.fixture(scope="module")
def server():
    return Credentials.of(RSAPrivateKey())


BOUND = binding(0, 4, False)


def _session(server: Credentials, steps: list[torch.Tensor], outs: list[torch.Tensor], positions=None, aux=None):
    """A server's commitments to ``steps`` (inputs) giving ``outs``, sealed: its opening, chain and signature."""
    signer = CommitSigner(server, sign_every=1000)
    key = ("client", "sid")
    chain: list[StepReply] = []
    position = 0
    for i, (x, y) in enumerate(zip(steps, outs, strict=True)):
        at = positions[i] if positions is not None else position
        chain.append(signer.reply(key, at, 1, x, y, BOUND, aux[i] if aux else ""))
        position = at + x.shape[1]
    sealed = signer.sealed(key, BOUND)
    return sealed, chain, sealed.chain_signature


def _steps():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(1, n, 8, generator=g) for n in (5, 1, 1, 1)]


def _evidence(server, outs=None, aux=None, **change) -> Evidence | None:
    steps = _steps()
    outs = outs or [x * 2 for x in steps]
    opening, chain, signature = _session(server, steps, outs, aux=aux)
    kwargs = dict(
        session_id="sid",
        opening=opening,
        chain=chain,
        signature=signature,
        context=torch.cat(steps, dim=1),
        bad=6,
        output=outs[2],
    )
    kwargs.update(change)
    return build(**kwargs)


def test_evidence_binds_the_accused_to_its_output_and_context(server):
    evidence = _evidence(server)
    assert evidence is not None
    facts = check(evidence, server.peer_id, 0, 4)
    assert facts.offset == 6 and facts.inputs.shape == (1, 7, 8) and facts.output.shape == (1, 1, 8)
    assert torch.equal(facts.output, facts.inputs[:, 6:7] * 2)
    # it round-trips through a DHT record unchanged
    item = Accusation(
        accused=server.peer_id, model_id="m", fingerprint="f", start=0, end=4, reason="r", made=1.0, evidence=evidence
    )
    again = Accusations.model_validate(Accusations(accuser="someone", items=(item,)).to_wire())
    assert check(again.items[0].evidence, server.peer_id, 0, 4).offset == 6


def test_evidence_that_does_not_bind_the_accused_proves_nothing(server):
    evidence = _evidence(server)
    assert evidence is not None
    other = Credentials.of(RSAPrivateKey())
    with pytest.raises(BadInputError, match="certified"):
        check(evidence, other.peer_id, 0, 4)  # someone else's commitments
    with pytest.raises(BadInputError, match="signature"):
        check(evidence, server.peer_id, 0, 8)  # other blocks than the session ran
    forged = evidence.model_copy(update={"output": TensorBlob.of(torch.zeros(1, 1, 8))})
    with pytest.raises(BadInputError, match="output"):
        check(forged, server.peer_id, 0, 4)  # another output than the one committed to
    context = evidence.inputs.tensor()
    context[0, 0, 0] += 1.0
    with pytest.raises(BadInputError, match="context at 0"):
        check(evidence.model_copy(update={"inputs": TensorBlob.of(context)}), server.peer_id, 0, 4)
    with pytest.raises(BadInputError, match="signature"):
        check(evidence.model_copy(update={"commitments": evidence.commitments[:-1]}), server.peer_id, 0, 4)
    with pytest.raises(BadInputError, match="cache held"):
        check(evidence.model_copy(update={"pieces": evidence.pieces[1:]}), server.peer_id, 0, 4)
    short = TensorBlob.of(torch.zeros(1, 2, 8)).model_copy(update={"shape": (1, 3, 8)})
    with pytest.raises(BadInputError, match="malformed"):
        check(evidence.model_copy(update={"inputs": short}), server.peer_id, 0, 4)
    # a key of a kind the identity layer does not read breaks nothing: it proves nothing
    odd = evidence.model_copy(update={"public_key": "ssh-foo AAAAB3NzaC1mb28="})
    with pytest.raises(BadInputError):
        check(odd, server.peer_id, 0, 4)
    # a client cannot build evidence for a context or output the server did not commit to
    assert _evidence(server, output=torch.zeros(1, 1, 8)) is None
    assert _evidence(server, bad=5) is None  # the output of step 2 is not what step 1 gave out
    # nor for steps at other positions or with a mask (readers re-run plain prefixes)
    assert _evidence(server, aux=["", "", "ab" * 32, ""]) is None


def test_a_redone_step_cannot_be_stitched_into_the_context(server):
    """The server redid the step at 5 (B then B'); the step at 6 ran on B'. A context of A, B, C is not what its
    cache held: building from it fails, and forged pieces naming the replaced step are refused."""
    g = torch.Generator().manual_seed(6)
    a, b, b2, c = (torch.randn(1, n, 8, generator=g) for n in (5, 1, 1, 1))
    opening, chain, signature = _session(server, [a, b, b2, c], [a, b, b2, c * 2], positions=[0, 5, 5, 6])
    common = dict(session_id="sid", opening=opening, chain=chain, signature=signature, bad=6, output=c * 2)
    assert build(context=torch.cat([a, b, c], dim=1), **common) is None
    honest = build(context=torch.cat([a, b2, c], dim=1), **common)
    assert honest is not None and [p.index for p in honest.pieces] == [0, 2, 3]
    stitched = honest.model_copy(
        update={
            "inputs": TensorBlob.of(torch.cat([a, b, c], dim=1)),
            "pieces": (honest.pieces[0], Piece(index=1, start=5, length=1), honest.pieces[2]),
        }
    )
    with pytest.raises(BadInputError, match="cache held"):
        check(stitched, server.peer_id, 0, 4)


def test_evidence_across_speculative_steps_carries_their_rejected_drafts(server):
    """Steps of 4 positions at 5 and 7 (1 token and 3 drafts each), the first undone after 2 of them by the second:
    the context is what the cache held (a, 2 positions of s1, s2 whole), s1's rejected drafts ride as its tail so
    its digest checks, and a forged tail or context fails."""
    g = torch.Generator().manual_seed(8)
    a, s1, s2 = (torch.randn(1, n, 8, generator=g) for n in (5, 4, 4))
    opening, chain, signature = _session(server, [a, s1, s2], [a, s1, s2 * 3], positions=[0, 5, 7])
    common = dict(session_id="sid", opening=opening, chain=chain, signature=signature, bad=7, output=s2 * 3)
    context = torch.cat([a, s1[:, :2], s2], dim=1)
    assert build(context=context, **common) is None  # without the tail, s1's digest cannot be checked
    evidence = build(context=context, tails={5: s1[:, 2:]}, **common)
    assert evidence is not None and [(p.start, p.length, p.tail) for p in evidence.pieces] == [
        (0, 5, 0),
        (5, 2, 2),
        (7, 4, 0),
    ]
    facts = check(evidence, server.peer_id, 0, 4)
    assert facts.offset == 7 and facts.inputs.shape == (1, 11, 8)
    assert build(context=context, tails={5: s1[:, 2:] + 1}, **common) is None
    forged = evidence.model_copy(update={"tails": TensorBlob.of(s1[:, 2:] + 1)})
    with pytest.raises(BadInputError, match="context at 5"):
        check(forged, server.peer_id, 0, 4)
    extra = evidence.model_copy(update={"tails": TensorBlob.of(torch.cat([s1[:, 2:], s1[:, :1]], dim=1))})
    with pytest.raises(BadInputError, match="tails beyond"):
        check(extra, server.peer_id, 0, 4)
    # the tail cannot smuggle the dropped positions back into what the cache held
    moved = evidence.model_copy(
        update={"pieces": (evidence.pieces[0], Piece(index=1, start=5, length=4, tail=0), evidence.pieces[2])}
    )
    with pytest.raises(BadInputError):
        check(moved, server.peer_id, 0, 4)


def _record(peer_id: str, fingerprint: str = "f") -> ServerRecord:
    return record(peer_id=peer_id, fingerprint=fingerprint)  # online, blocks 0:4, float32


def test_readers_judge_by_the_majority_of_drawn_judges_and_wait_when_they_cannot(server):
    """``swarm.rpc.judging``, shared by clients and the broker: real evidence, judges whose re-runs are scripted."""
    evidence = _evidence(server, outs=[x * 2 for x in _steps()[:2]] + [_steps()[2] * 3] + [_steps()[3] * 2])
    assert evidence is not None
    item = Accusation(
        accused=server.peer_id, model_id="m", fingerprint="f", start=0, end=4, reason="r", made=1.0, evidence=evidence
    )
    accused = _record(server.peer_id)
    honest = {"a": (True, "a"), "b": (True, "b"), "c": (False, "c")}  # two see the cheat, one (a liar) does not

    def rerun(facts, hop):
        assert facts.offset == 6 and hop.peer_id in honest  # never the accused nor the accuser
        return honest[hop.peer_id]

    judges = [_record(p) for p in ("a", "b", "c")] + [accused, _record("accuser")]
    vouched = frozenset({"a", "b", "c", server.peer_id, "accuser"})
    for seed in range(8):  # whichever two are drawn first, the third breaks a tie: the majority convicts
        c = judge("accuser", item, accused, judges, rerun, random.Random(seed), trusted=vouched)
        assert c is not None and c.upheld and c.accused == server.peer_id
    # one judge each way and no third: not decided (waits); no judge or the accused unannounced: waits too
    two = [_record("a"), _record("c")]
    assert judge("accuser", item, accused, two, rerun, random.Random(0), trusted=vouched) is None
    assert judge("accuser", item, accused, [], rerun, random.Random(0), trusted=vouched) is None
    assert judge("accuser", item, None, judges, rerun, random.Random(0), trusted=vouched) is None
    assert (
        judge("accuser", item, _record(server.peer_id, "g"), judges, rerun, random.Random(0), trusted=vouched) is None
    )
    # the judges re-run it to the committed output: the accuser lied
    c = judge("accuser", item, accused, [_record("c")], rerun, random.Random(0), trusted=vouched)
    assert c is not None and not c.upheld
    # evidence that does not check convicts its accuser without a re-run
    forged = item.model_copy(
        update={"evidence": evidence.model_copy(update={"output": TensorBlob.of(torch.zeros(1, 1, 8))})}
    )
    c = judge("accuser", forged, accused, judges, rerun, random.Random(0))
    assert c is not None and not c.upheld and "does not check" in c.reason


def test_servers_that_merely_announce_the_weights_never_judge(server):
    """Sybils: any number of records announcing the accused's span and fingerprint, every one re-running the
    evidence wrong, convict nobody for a reader that vouches for none of them; a reader that holds the weights
    decides alone, whatever judges say; a judge that fails is not drawn again for that accusation."""
    evidence = _evidence(server, outs=[x * 2 for x in _steps()[:2]] + [_steps()[2] * 3] + [_steps()[3] * 2])
    assert evidence is not None
    item = Accusation(
        accused=server.peer_id, model_id="m", fingerprint="f", start=0, end=4, reason="r", made=1.0, evidence=evidence
    )
    accused = _record(server.peer_id)
    sybils = [_record(f"sybil{i}") for i in range(20)]
    asked: list[str] = []

    def lying(facts, hop):
        asked.append(hop.peer_id)
        return (True, "a lie")

    assert judge("accuser", item, accused, sybils, lying, random.Random(0)) is None
    assert judge("accuser", item, accused, sybils, lying, random.Random(0), trusted=frozenset({"other"})) is None
    assert asked == []
    # the reader's own run: the committed output (what an honest server gives) decides, judges are not asked
    facts = check(item.evidence, server.peer_id, 0, 4)
    honest = lambda inputs, start, end, fp: facts.output if fp == "f" else None  # noqa: E731
    padded = lambda inputs, start, end, fp: torch.cat([inputs[:, : facts.offset], honest(inputs, start, end, fp)], 1)  # noqa: E731
    c = judge("accuser", item, accused, sybils, lying, random.Random(0), local=padded, trusted=frozenset({"sybil0"}))
    assert c is not None and not c.upheld and asked == []
    wrong = lambda inputs, start, end, fp: padded(inputs, start, end, fp) * 1.5  # noqa: E731
    c = judge("accuser", item, accused, [], lying, random.Random(0), local=wrong)
    assert c is not None and c.upheld
    # a reader without these weights (local answers None) falls back to its vouched judges; a failed one is noted
    none = lambda inputs, start, end, fp: None  # noqa: E731
    failed: set[str] = set()
    stalled = lambda facts, hop: asked.append(hop.peer_id)  # noqa: E731 - answers None: the judge failed
    one = frozenset({"sybil3"})
    assert (
        judge("accuser", item, accused, sybils, stalled, random.Random(0), local=none, trusted=one, failed=failed)
        is None
    )
    assert asked == ["sybil3"] and failed == {"sybil3"}
    assert (
        judge("accuser", item, accused, sybils, stalled, random.Random(0), local=none, trusted=one, failed=failed)
        is None
    )
    assert asked == ["sybil3"]  # not drawn again


def test_a_reader_vouches_only_after_windows_of_agreement_and_never_for_the_convicted():
    docket = Docket("me", "m")
    for _ in range(VOUCH_WINDOWS - 1):
        docket.vouch("a", "b")
    assert docket.trusted == frozenset()
    docket.vouch("a", "b")
    assert docket.trusted == {"a", "b"}
    docket.judged[("p", 1.0, "a")] = Conviction("a", "p", "r", True)
    assert docket.trusted == {"b"}


def test_a_docket_takes_up_one_accusation_per_accuser_and_look(server):
    evidence = _evidence(server)
    assert evidence is not None

    def item(made: float, accused: str = "x", model: str = "m") -> Accusation:
        return Accusation(
            accused=accused, model_id=model, fingerprint="f", start=0, end=4, reason="r", made=made, evidence=evidence
        )

    records = [
        Accusations(accuser="p", items=(item(1.0, "x"), item(2.0, "y"))),
        Accusations(accuser="q", items=(item(1.0, "z", "other model"),)),
        Accusations(accuser="r", items=(item(99.0, "w"),)),  # dated after what the reader accepts
        Accusations(accuser="me", items=(item(1.0, "v"),)),
    ]
    docket = Docket("me", "m", rng=random.Random(0))
    assert [(a, i.accused) for a, i in docket.due(records, 0.0, 10.0)] == [("p", "y")]
    verdicts = {"y": None, "x": Conviction("x", "p", "r", True)}
    assert docket.take_up(records, 0.0, 10.0, lambda accuser, i, failed: verdicts[i.accused]) == []
    # "y" waits RETRY_AFTER: the next look takes p's next newest
    assert [c.accused for c in docket.take_up(records, 1.0, 10.0, lambda a, i, failed: verdicts[i.accused])] == ["x"]
    assert docket.convicted == {"x"} and docket.due(records, 2.0, 10.0) == []
    verdicts["y"] = Conviction("y", "p", "lie", False)
    assert [
        c.accused for c in docket.take_up(records, RETRY_AFTER, 10.0, lambda a, i, failed: verdicts[i.accused])
    ] == ["y"]
    assert "p" in docket.false_accusers and docket.due(records, 2 * RETRY_AFTER, 10.0) == []  # p is ignored now


def test_an_accusation_no_one_can_judge_is_dropped_after_its_attempts(server):
    """A judge that never answers (or none at all) keeps an accusation pending only ``MAX_ATTEMPTS`` looks: then it
    is dropped undecided, convicting no one and costing its accuser nothing."""
    evidence = _evidence(server)
    assert evidence is not None
    item = Accusation(
        accused="x", model_id="m", fingerprint="f", start=0, end=4, reason="r", made=1.0, evidence=evidence
    )
    records = [Accusations(accuser="p", items=(item,))]
    docket = Docket("me", "m", rng=random.Random(0))
    looks = 0
    for look in range(MAX_ATTEMPTS + 2):
        now = look * RETRY_AFTER
        if docket.due(records, now, 10.0):
            looks += 1
        assert docket.take_up(records, now, 10.0, lambda a, i, failed: None) == []
    assert looks == MAX_ATTEMPTS
    assert docket.due(records, 100 * RETRY_AFTER, 10.0) == [] and docket.convicted == set()
    assert "p" not in docket.false_accusers


def test_a_re_run_cuts_its_pieces_around_every_prompt_as_the_hop_ran_it():
    """A verifier runs a window as one piece but each multi-token step (a prompt, a prefill chunk) as the hop ran
    it: in bfloat16 a prefill's first positions round by its length (SmolLM2: 0.19-0.25 apart at position 1, over
    the 0.1 honest servers may differ by), and a window that began with the prompt set honest servers in dispute."""
    from swarm.client.verify.shadow import step_cuts

    assert step_cuts([8, 1, 1, 1]) == [8]  # the prompt alone, then the decode steps together
    assert step_cuts([1, 1, 1]) == []  # decode steps only: one piece
    assert step_cuts([1, 1, 5, 1, 3]) == [2, 7, 8]  # each longer step on its own, single steps grouped
    assert step_cuts([256, 256, 1]) == [256, 512]
    assert step_cuts([]) == []
