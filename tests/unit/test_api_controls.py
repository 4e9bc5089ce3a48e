"""The API's token picking against reference implementations written from the specifications (OpenAI's penalty
and bias formula, min-p and top-k from their papers' definitions), constrained decoding with SmolLM2's real
tokenizer (whatever the logits, every answer parses and validates), tool calls read back, and the conformance table
against the installed ``openai`` client's request types."""

from __future__ import annotations

import json
import typing

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.api import conformance
from swarm.api.controls import ChoiceState, Controls, logprob_of
from swarm.api.grammar import Vocabulary
from swarm.api.schema import ChatRequest
from swarm.api.tools import Watch, parse, render
from swarm.errors import BadInputError
from tests.helpers.examples import fuzz_examples
from tests.helpers.schemas import SCHEMAS, closed

VOCAB = 12


def _reference_scores(logits, counts, presence, frequency, bias):
    """OpenAI's documented formula, element by element: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres + bias[j]."""
    out = []
    for j, mu in enumerate(logits):
        c = counts.get(j, 0)
        out.append(mu - c * frequency - (1.0 if c > 0 else 0.0) * presence + bias.get(j, 0.0))
    return out


@settings(max_examples=fuzz_examples(60), deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=VOCAB, max_size=VOCAB),
    sampled=st.lists(st.integers(0, VOCAB - 1), max_size=20),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
)
def test_penalties_and_bias_follow_openais_formula(logits, sampled, presence, frequency, bias):
    c = Controls(presence_penalty=presence, frequency_penalty=frequency, logit_bias=tuple(sorted(bias.items())))
    state = ChoiceState(c, 0, VOCAB)
    for t in sampled:
        state.took(t)
    counts = {t: sampled.count(t) for t in set(sampled)}
    want = _reference_scores(logits, counts, presence, frequency, bias)
    got = state.scores(torch.tensor(logits, dtype=torch.float32)).tolist()
    assert np.allclose(got, want, atol=1e-4)
    greedy = ChoiceState(
        Controls(
            temperature=0.0, **{k: getattr(c, k) for k in ("presence_penalty", "frequency_penalty", "logit_bias")}
        ),
        0,
        VOCAB,
    )
    for t in sampled:
        greedy.took(t)
    assert greedy.pick(torch.tensor(logits), 0, None) == int(np.argmax(np.float32(want)))


def test_penalties_change_greedy_output_as_specified():
    logits = torch.tensor([3.0, 2.5, 0.0, 0.0])
    state = ChoiceState(Controls(temperature=0.0, frequency_penalty=0.3), 0, 4)
    picks = []
    for _ in range(4):
        picks.append(state.pick(logits, 0, None))
        state.took(picks[-1])
    # token 0 leads by 0.5: after two uses (0.6 of penalty) token 1 leads; then they alternate by counts
    assert picks == [0, 0, 1, 0]
    banned = ChoiceState(Controls(temperature=0.0, logit_bias=((0, -100.0),)), 0, 4)
    assert banned.pick(logits, 0, None) == 1
    forced = ChoiceState(Controls(temperature=1.0, seed=3, logit_bias=((3, 100.0),)), 0, 4)
    assert all(forced.pick(logits, p, None) == 3 for p in range(20))  # +100: the token is certain


def _reference_probs(logits, temperature, top_k, min_p):
    """Temperature, then top-k (the k largest), then min-p (tokens with p >= min_p * p_max), renormalised."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    p = np.exp(z - z[keep].max()) * keep
    p /= p.sum()
    if min_p:
        keep &= p >= min_p * p.max()
        p = p * keep
        p /= p.sum()
    return p


@settings(max_examples=fuzz_examples(60), deadline=None)
@given(
    logits=st.lists(st.integers(-40, 40), min_size=VOCAB, max_size=VOCAB, unique=True).map(
        lambda v: [x / 8 for x in v]
    ),
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(0, VOCAB),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)
def test_top_k_and_min_p_match_their_definitions(logits, temperature, top_k, min_p):
    sampler = Controls(temperature=temperature, top_k=top_k, min_p=min_p).sampler()
    got = sampler.probs(torch.tensor([logits], dtype=torch.float32))[0].double().numpy()
    assert np.allclose(got, _reference_probs(logits, temperature, top_k, min_p), atol=1e-5)


def test_logprobs_are_the_models_own():
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0])
    entry = logprob_of(logits, 1, 2)
    ref = torch.log_softmax(logits.double(), -1)
    assert abs(entry.logprob - float(ref[1])) < 1e-6
    assert [t for t, _ in entry.top] == [2, 1] and abs(entry.top[0][1] - float(ref[2])) < 1e-6


# ---- constrained decoding ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab(smollm_folder):
    from swarm.model_files import load_tokenizer

    tokenizer = load_tokenizer(smollm_folder)
    return tokenizer, Vocabulary(tokenizer, len(tokenizer), frozenset({int(tokenizer.eos_token_id)}))


def test_any_logits_give_answers_that_validate(vocab):
    """10 schemas x 10 seeds, random logits biased toward ending: every answer parses and matches its schema."""
    tokenizer, v = vocab
    eos = int(tokenizer.eos_token_id)
    for schema in map(closed, SCHEMAS):
        grammar = v.json(schema, "response_format")
        for seed in range(10):
            matcher = v.matcher(grammar)
            state = ChoiceState(Controls(temperature=1.0, seed=seed), 0, len(tokenizer), matcher)
            g = torch.Generator().manual_seed(seed)
            out: list[int] = []
            for position in range(300):
                logits = torch.randn(len(tokenizer), generator=g) * 3
                logits[eos] += 30  # an end is taken as soon as the grammar allows it
                token = state.pick(logits, position, None)
                if token == eos or matcher.done:
                    if token != eos:
                        out.append(token)
                    break
                state.took(token)
                out.append(token)
            else:
                raise AssertionError(f"no end within 300 tokens: {tokenizer.decode(out)!r}")
            jsonschema.validate(json.loads(tokenizer.decode(out)), schema)


def test_tool_call_grammar_and_reading_back(vocab):
    tokenizer, v = vocab
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    grammar = v.tool_calls({"get_weather": params, "get_time": None}, parallel=False)
    matcher = v.matcher(grammar)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for t in tokenizer(good, add_special_tokens=False)["input_ids"]:
        matcher.take(t)
    assert matcher.m.is_accepting()
    wrong = v.matcher(grammar)
    with pytest.raises(BadInputError):  # a function the request does not offer
        for t in tokenizer('<tool_call>\n{"name":"rm"', add_special_tokens=False)["input_ids"]:
            wrong.take(t)
    content, calls = parse(good, {"get_weather"})
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}', {"get_weather"})[1][0].name == "get_weather"
    assert parse('<tool_call>\n{"name": "other"}\n</tool_call>', {"get_weather"})[1] == []  # not offered: text
    assert parse("Paris is sunny.", {"get_weather"}) == ("Paris is sunny.", [])


def test_a_schema_that_does_not_compile_is_a_bad_request(vocab):
    from swarm.api.errors import ApiError

    with pytest.raises(ApiError) as e:
        vocab[1].json({"type": "objekt"}, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format"


def test_auto_tool_choice_holds_text_only_while_it_may_be_a_call():
    w = Watch()
    assert w.add(" <tool") == " " and w.add("_call>\n{") == "" and w.mode == "calls"  # what may begin one: held
    w = Watch()
    assert w.add("<to") == "" and w.add("day is") == "<today is" and w.add(" fine") == " fine"
    w = Watch()
    assert w.add("Sure! <tool_") == "Sure! " and w.add("call>{") == "" and w.held == "<tool_call>{"  # after text
    w = Watch()
    assert w.add('{"na') == "" and w.add('me": "f"') == "" and w.mode == "calls"


def test_tools_render_natively_or_as_hermes_blocks():
    req = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        }
    )
    messages, tools = render(req, native=True)
    assert tools and tools[0]["function"]["name"] == "w"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "w"}
    messages, tools = render(req, native=False)
    assert tools is None and messages[0]["role"] == "system" and '"name": "w"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


# ---- the conformance table --------------------------------------------------------------------------------------
def test_the_table_lists_every_field_of_openais_request_types():
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_params

    official = {
        "chat": set(typing.get_type_hints(chat_params.CompletionCreateParamsBase)) | {"stream"},
        "completions": set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | {"stream"},
        "embeddings": set(typing.get_type_hints(embedding_create_params.EmbeddingCreateParams)),
    }
    for endpoint, fields in conformance.TABLE.items():
        listed = [f.name for f in fields]
        assert len(listed) == len(set(listed)), endpoint
        assert official[endpoint] <= set(listed), (endpoint, official[endpoint] - set(listed))
        for f in fields:
            assert f.note and f.status in ("honoured", "ignored", "refused")


def test_the_docs_print_the_table():
    from pathlib import Path

    root = Path(__file__).parents[2]
    assert conformance.markdown() in (root / "docs" / "api.md").read_text()
    assert conformance.summary() in (root / "README.md").read_text()


def test_hostile_schemas_are_refused_or_bounded(vocab):
    """Nesting deeper than the JSON parser's limit is a 400; a wide union of patterns and a catastrophic-looking
    regex compile into grammars whose masks are computed at once (llguidance's lexer is linear, its parser bounded)."""
    from swarm.api.errors import ApiError

    _, v = vocab
    deep: dict = {"type": "integer"}
    for _ in range(190):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ApiError) as e:
        v.json(deep, "response_format")
    assert e.value.status == 400
    wide = {"anyOf": [{"type": "string", "pattern": f"^(a|b)*c{{{i}}}$"} for i in range(300)]}
    evil = {"type": "string", "pattern": "^(a|aa)*(a{1,20}){1,20}b$"}
    for schema in (wide, evil):
        assert v.matcher(v.json(schema, "response_format")).allowed().any()


class _Served:
    """What a choice reads of a served model: its real tokenizer, vocabulary and end tokens (no swarm needed)."""

    def __init__(self, tokenizer, vocab) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self.eos = frozenset({int(tokenizer.eos_token_id)})
        self.n_vocab = vocab.n_vocab

    def vocabulary(self, param: str):
        return self.vocab


def _decode(served, sampling, text: str, eos: bool = True):
    """Run one choice greedily over logits that point at ``text``'s tokens one by one (then the end)."""
    from swarm.api.engine import _Choice

    ids = served.tokenizer(text, add_special_tokens=False)["input_ids"] + ([min(served.eos)] if eos else [])
    choice, pieces = _Choice(served, sampling, 0), []
    for k, token in enumerate(ids):
        logits = torch.zeros(served.n_vocab)
        logits[token] = 50.0
        pieces.append(choice.step(logits, k, None, last=k + 1 == sampling.max_tokens))
        if pieces[-1].finish:
            break
    return pieces


def test_a_choice_reads_calls_back_as_its_mode_says(vocab):
    from swarm.api.engine import Sampling

    served = _Served(*vocab)
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    auto = Sampling(200, Controls(temperature=0.0), tools=frozenset({"f"}))
    pieces = _decode(served, auto, "Sure! " + call)
    assert "".join(p.text for p in pieces).strip() == "Sure!" and pieces[-1].finish == "tool_calls"
    assert [(c.name, c.arguments) for c in pieces[-1].calls] == [("f", '{"x": 1}')]
    two = _decode(served, Sampling(200, Controls(temperature=0.0), tools=frozenset({"f"}), parallel=False), call + call)
    assert len(two[-1].calls) == 1  # parallel_tool_calls false: one call
    cut = _decode(served, Sampling(30, Controls(temperature=0.0), tools=frozenset({"f"})), call + call, eos=False)
    assert cut[-1].finish == "length" and not cut[-1].calls  # an answer cut short is not read as calls
    plain = _decode(served, auto, "No call: <b>bold</b> text")
    assert "".join(p.text for p in plain) == "No call: <b>bold</b> text" and plain[-1].finish == "stop"
    stopped = _decode(served, Sampling(200, Controls(temperature=0.0), stops=("<b>",)), "No call: <b>bold</b>")
    assert "".join(p.text for p in stopped) == "No call: " and stopped[-1].finish == "stop"


def test_a_long_answer_of_spaces_is_parsed_at_once():
    """A lazy regular expression around whitespace backtracked for minutes over such answers; the scan is linear."""
    assert parse("<tool_call>" + " " * 150_000, {"f"}) == ("<tool_call>" + " " * 150_000, [])
    assert parse("<tool_call>" + "\n" * 100_000 + "</tool_call>", {"f"})[1] == []
