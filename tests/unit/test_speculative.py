"""Speculative decoding's loop and rules (``swarm.client.speculative.loop``, ``swarm.client.speculative.drafting``)
against local targets: a Hugging Face model with a KV cache that forgets what is taken back, as servers do, and a bigram
table whose exact sequence distribution is known. Greedy decoding must give plain greedy's tokens with every drafter;
sampling must give plain sampling's distribution (a chi-square test on seeded draws: the same draws every run)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

from swarm.client.speculative.drafting import ModelDrafter, NgramDrafter, drafter_factory, truncated
from swarm.client.speculative.loop import Draft, Drafter, Lengths, Sampler, Speculation, Trace, accept, decode
from swarm.errors import BadInputError
from tests.helpers.models import local_reference


class LocalTarget:
    """A model with a cache, stepped as a session is: holds positions, forgets the last ones on ``take_back``,
    never more than the last step's (the servers' rule)."""

    def __init__(self, model) -> None:
        self.model, self.cache, self.held, self.last = model, DynamicCache(), 0, 0
        self.steps: list[int] = []

    def step(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens]), cache=self.cache, use_cache=True)
        self.held += len(tokens)
        self.last = len(tokens)
        self.steps.append(len(tokens))
        return out.logits[0]

    def take_back(self, drop: int) -> None:
        assert 0 <= drop < self.last, "took back more than the last step's drafts"
        if drop:
            self.cache.crop(-drop)
            self.held -= drop
        self.last = 0


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"], local_reference(tiny_models["llama"])


def repetitive_prompt() -> list[int]:
    g = torch.Generator().manual_seed(5)
    text = torch.randint(3, 300, (24,), generator=g).tolist()
    return text + text[:10]  # the model's greedy continuation often repeats a span: n-grams find it


@pytest.mark.parametrize("drafter", ["ngram", "first:1", "self", "contrary"])
def test_greedy_speculation_gives_plain_greedy_tokens(llama, drafter):
    folder, model = llama
    prompt = repetitive_prompt()
    want = plain_greedy(model, prompt, 40)
    if drafter == "self":  # drafts always right: several tokens a trip
        made: Drafter = ModelDrafter(local_reference(folder), "self")
    elif drafter == "contrary":  # drafts never right: one token a trip, every draft taken back
        made = Contrary(model)
    else:
        made = drafter_factory(drafter, folder, folder.parent)()
    target = LocalTarget(model)
    trace = Trace()
    got = decode(
        prompt,
        step=target.step,
        take_back=target.take_back,
        drafter=made,
        sampler=Sampler(),
        max_new=40,
        lengths=Lengths(max_k=5, fixed=3),
        trace=trace,
    )
    assert got == want
    assert target.held == len(prompt) + len(got) - 1  # the servers hold all but the last token
    if drafter == "self":
        assert trace.kept == trace.drafted > 0 and trace.trips < 20
    if drafter == "contrary":
        assert trace.kept == 0 and trace.trips == 39


class Contrary(Drafter):
    """Drafts the target's least likely token: always rejected."""

    def __init__(self, model) -> None:
        self.model = model

    def propose(self, tokens, k, sampler, generator):
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([list(tokens)])).logits[0, -1]
        return Draft(tuple([int(logits.argmin())] * k))


def test_eos_inside_accepted_drafts_ends_there_and_leaves_no_draft_held(llama):
    folder, model = llama
    prompt = repetitive_prompt()
    want = plain_greedy(model, prompt, 30)
    eos = want[7]
    first = want.index(eos)
    target = LocalTarget(model)
    got = decode(
        prompt,
        step=target.step,
        take_back=target.take_back,
        drafter=ModelDrafter(local_reference(folder), "self"),
        sampler=Sampler(),
        max_new=30,
        eos=frozenset({eos}),
        lengths=Lengths(fixed=6, max_k=6),
    )
    assert got == want[: first + 1]
    assert target.held == len(prompt) + len(got) - 1


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(3)
    s = Sampler()
    assert d.propose([1, 2, 3, 4, 5, 9, 2, 3], 2, s, None).tokens == (4, 5)
    assert d.propose([1, 2, 3, 4, 2, 3, 7, 2, 3], 3, s, None).tokens == (7, 2, 3)  # the latest occurrence
    assert d.propose([5, 6, 7], 3, s, None).tokens == ()  # nothing repeats
    assert d.propose([4, 4, 4], 5, s, None).tokens == (4,)
    with pytest.raises(BadInputError):
        NgramDrafter(0)


def test_truncated_drafter_is_the_served_model_cut_to_its_first_blocks(llama):
    folder, model = llama
    cut = truncated(folder, 1)
    assert cut.config.num_hidden_layers == 1
    torch.testing.assert_close(cut.get_input_embeddings().weight, model.get_input_embeddings().weight)
    torch.testing.assert_close(cut.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(BadInputError, match="blocks"):
        truncated(folder, 99)
    with pytest.raises(BadInputError):
        drafter_factory("first:x", folder, folder.parent)


# ---- sampling: the distribution is plain sampling's ---------------------------------------------------------------
V = 4  # tokens of the bigram world: sequences of 3 new tokens have 64 outcomes


def bigram(seed: int) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.5


class Bigram:
    """A target whose logits at a position depend on the previous token only."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table, self.held, self.tokens = table, 0, []

    def step(self, tokens: list[int]) -> torch.Tensor:
        self.tokens += tokens
        return self.table[torch.tensor(tokens)]

    def take_back(self, drop: int) -> None:
        if drop:
            del self.tokens[-drop:]


class BigramDrafter(Drafter):
    """Samples drafts from another bigram table (its own distribution q), or proposes them greedily."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def propose(self, tokens, k, sampler, generator):
        out, probs, last = [], [], tokens[-1]
        for _ in range(k):
            p = sampler.probs(self.table[last : last + 1])[0]
            last = int(torch.multinomial(p, 1, generator=generator))
            out.append(last)
            probs.append(p)
        return Draft(tuple(out), torch.stack(probs))


def exact(table: torch.Tensor, sampler: Sampler, first: int, n: int) -> dict[tuple[int, ...], float]:
    p = sampler.probs(table)
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        prob, last = 1.0, first
        for t in seq:
            prob *= float(p[last, t])
            last = t
        out[seq] = prob
    return out


def chi_square(counts: dict[tuple[int, ...], int], want: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for key, prob in want.items():
        expected = prob * n
        if expected >= 5:
            stat += (counts.get(key, 0) - expected) ** 2 / expected
            cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("drafter", ["sampled", "ngram", "seeded", "seeded-ngram"])
def test_speculative_sampling_keeps_the_target_distribution(drafter):
    """Unseeded: speculative sampling (rejection). Seeded: Gumbel-max with each position's own noise, a draft kept
    while it is the sampled token (one seed per run here, so the runs sample the distribution)."""
    table, sampler = bigram(1), Sampler(temperature=0.9, top_k=0, top_p=1.0)
    made: Drafter = BigramDrafter(bigram(2)) if drafter in ("sampled", "seeded") else NgramDrafter(2)
    gen = torch.Generator().manual_seed(123)
    runs, counts, trace = 6000, {}, Trace()
    prompt = [0, 1, 2, 1, 2, 3, 0, 1]  # n-grams of the prompt give the n-gram drafter something to propose
    for run in range(runs):
        if drafter.startswith("seeded"):
            sampler = Sampler(temperature=0.9, seed=run)
        target = Bigram(table)
        out = decode(
            prompt,
            step=target.step,
            take_back=target.take_back,
            drafter=made,
            sampler=sampler,
            max_new=3,
            lengths=Lengths(fixed=2, max_k=2),
            generator=gen,
            trace=trace,
        )
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, dof = chi_square(counts, exact(table, sampler, prompt[-1], 3), runs)
    # chi-square's 99.9% point for these degrees of freedom is under 2 dof + 20; a biased rule lands far above
    assert stat < 2 * dof + 20, (stat, dof)
    assert 0 < trace.kept < trace.drafted  # drafts were both kept and rejected


def test_a_seed_gives_the_same_tokens_whatever_the_drafts(llama):
    """Seeded sampling: with no drafts, drafts of every length, always-right and always-wrong drafts, the same text."""
    folder, model = llama
    prompt = repetitive_prompt()
    outs = []
    for drafter, k in [
        (NgramDrafter(), 0),
        (NgramDrafter(), 3),
        (ModelDrafter(local_reference(folder), "self"), 5),
        (Contrary(model), 2),
        (ModelDrafter(truncated(folder, 1), "first:1"), 4),
    ]:
        target = LocalTarget(model)
        outs.append(
            decode(
                prompt,
                step=target.step,
                take_back=target.take_back,
                drafter=drafter,
                sampler=Sampler(temperature=1.0, top_p=0.95, seed=11),
                max_new=24,
                lengths=Lengths(fixed=k, max_k=max(k, 1)),
            )
        )
    assert all(o == outs[0] for o in outs)
    assert outs[0] != plain_greedy(model, prompt, 24)  # it sampled


def test_a_biased_accept_rule_fails_the_same_test():
    """The test has power: keeping every sampled draft (no rejection) is caught."""
    table, sampler = bigram(1), Sampler(temperature=0.9)
    drafts = BigramDrafter(bigram(2))
    gen = torch.Generator().manual_seed(123)
    counts: dict[tuple[int, ...], int] = {}
    runs = 6000
    for _ in range(runs):
        d = drafts.propose([2], 3, sampler, gen)
        counts[d.tokens] = counts.get(d.tokens, 0) + 1
    stat, dof = chi_square(counts, exact(table, sampler, 2, 3), runs)
    assert stat > 2 * dof + 20


def test_accept_rule_greedy_and_point_mass():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert accept(logits, Draft((1, 0)), Sampler()) == (2, 2)
    assert accept(logits, Draft((1, 2)), Sampler()) == (1, 0)
    assert accept(logits, Draft((2,)), Sampler()) == (0, 1)
    # a point-mass draft with p(x) = 1 is always kept
    sure = torch.tensor([[-1e9, 0.0, -1e9], [0.0, -1e9, -1e9]])
    assert accept(sure, Draft((1,)), Sampler(temperature=1.0), torch.Generator().manual_seed(0)) == (1, 0)


def test_lengths_go_quiet_when_drafts_fail_and_long_when_they_pass():
    cheap = Lengths(max_k=8)
    for _ in range(30):
        cheap.trip(positions=5, seconds=0.100, drafted=4, kept=4)
        cheap.trip(positions=2, seconds=0.100, drafted=1, kept=1)
    assert cheap.choose() == 8  # behind a link: every extra position is free and every draft is kept
    busy = Lengths(max_k=8)
    for _ in range(30):
        busy.trip(positions=5, seconds=0.050, drafted=4, kept=0)
        busy.trip(positions=2, seconds=0.030, drafted=1, kept=0)
        busy.trip(positions=1, seconds=0.020, drafted=0, kept=0)
    assert [busy.choose() for _ in range(16)] == [0] * 16  # every extra position costs, no draft is kept: quiet

    shape = Lengths()  # one position 62 ms, two 89, then 3.5 ms a position (SmolLM2 over 3 CPU servers)
    for n, t in [(1, 0.062), (2, 0.089), (5, 0.0995), (9, 0.1135)] * 10:
        shape.trip(n, t, n - 1, 0)
    t1, t2, slope = shape.cost()
    assert abs(t1 - 0.062) < 1e-3 and abs(t2 - 0.089) < 2e-3 and abs(slope - 0.0035) < 5e-4

    def probes(lengths: Lengths, trips: int, kept: int) -> list[int]:
        """At which trips a quiet kind was probed, each probe's draft kept or not."""
        at = []
        for i in range(trips):
            if lengths.choose("n") == 1:
                at.append(i)
                lengths.trip(2, 0.07, 1, kept, "n")
            else:
                lengths.trip(1, 0.05, 0, 0, "n")
        return at

    failing = Lengths(prior_jump=2.0)
    failing.trip(1, 0.05, 0, 0)
    at = probes(failing, 200, 0)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert at[0] == 7 and gaps[:3] == [16, 32, 64]  # the first after 8 quiet trips, then each failure doubles
    assert Lengths(fixed=3).choose() == 3
    with pytest.raises(BadInputError):
        Speculation(k=9, max_k=8)


def test_sampler_refuses_options_it_cannot_honour():
    from transformers import GenerationConfig

    assert Sampler.of(GenerationConfig(do_sample=False)).greedy
    s = Sampler.of(GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9))
    assert (s.temperature, s.top_p) == (0.7, 0.9)
    with pytest.raises(BadInputError, match="repetition_penalty"):
        Sampler.of(GenerationConfig(repetition_penalty=1.3))
