"""What applications build on, through ``python -m swarm.api`` over a real loopback swarm serving SmolLM2-135M-Instruct,
driven by the official ``openai`` client: log-probabilities equal to local Hugging Face's, tool calls round trip
(streamed and not), every ``json_schema`` answer parses and validates, ``logit_bias`` changes the answer,
embeddings equal the local model's pooled hidden states, and every row of the conformance table is answered as it
says."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from harness.local_swarm import ApiProcess
from swarm.api import conformance
from tests.helpers.models import local_reference
from tests.helpers.schemas import SCHEMAS, closed
from tests.helpers.swarms import running_swarm

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "features-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: called with {}


@pytest.fixture(scope="module")
def api(smollm_folder):
    with running_swarm(MODEL, ["0:15", "15:30"]) as swarm:
        args = ("--model", MODEL, "--api-key", KEY, "--codec", "none", "--max-concurrent", "4")
        with ApiProcess(swarm.initial_peers, *args, "--max-client-concurrent", "4") as process:
            yield process


@pytest.fixture(scope="module")
def reference(smollm_folder):
    from swarm.model_files import load_tokenizer

    return local_reference(smollm_folder), load_tokenizer(smollm_folder)


def _client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_greedy_logprobs_equal_local_hugging_face(api, reference):
    model, tokenizer = reference
    reply = _client(api).chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5
    )
    entries = reply.choices[0].logprobs.content
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(prompt["input_ids"])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
        logp = torch.log_softmax(model(torch.tensor([out])).logits[0].double(), -1)
    answer = [t for t in out[len(ids) :] if t != tokenizer.eos_token_id]
    assert len(entries) == len(answer)
    for k, (entry, token) in enumerate(zip(entries, answer, strict=True)):
        row = logp[len(ids) + k - 1]
        assert bytes(entry.bytes).decode() == entry.token == tokenizer.decode([token])
        assert abs(entry.logprob - float(row[token])) < 1e-4
        best = row.topk(5)
        assert all(abs(a.logprob - float(b)) < 1e-4 for a, b in zip(entry.top_logprobs, best.values, strict=True))
        assert [tokenizer.decode([i]) for i in best.indices.tolist()] == [a.token for a in entry.top_logprobs]
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the best one

    prompt_text = "The capital of France is"
    scored = _client(api).completions.create(model=MODEL, prompt=prompt_text, max_tokens=0, echo=True, logprobs=3)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt_text and lp.token_logprobs[0] is None
    pids = tokenizer(prompt_text)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([pids])).logits[0].double(), -1)
    want = [float(ref[i - 1, pids[i]]) for i in range(1, len(pids))]
    assert np.allclose(lp.token_logprobs[1:], want, atol=1e-4)
    assert "".join(lp.tokens) == prompt_text and lp.text_offset[-1] == len(prompt_text) - len(lp.tokens[-1])


def _call_round_trip(api, stream: bool) -> tuple[str, dict, str]:
    client = _client(api)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {
        "model": MODEL,
        "max_tokens": 48,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "parallel_tool_calls": False,
    }
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kwargs):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and len(calls) >= 1
        first = calls[0]
        call_id, name, arguments = first["id"], first["name"], first["arguments"]
    else:
        reply = client.chat.completions.create(messages=messages, tool_choice="required", **kwargs)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        tool_call = reply.choices[0].message.tool_calls[0]
        call_id, name, arguments = tool_call.id, tool_call.function.name, tool_call.function.arguments
    assert name in ("get_weather", "get_time")
    args = json.loads(arguments)
    if name == "get_weather":
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 degrees Celsius."},
    ]
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, tool_choice="none", stream=True, **kwargs))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = (
            client.chat.completions.create(messages=messages, tool_choice="none", **kwargs).choices[0].message.content
        )
    return name, args, answer


def test_a_tool_call_round_trip_streamed_and_not(api):
    plain = _call_round_trip(api, stream=False)
    streamed = _call_round_trip(api, stream=True)
    assert plain == streamed  # greedy: the same call and the same answer either way
    assert plain[0] == "get_weather" and plain[2].strip()
    named = _client(api).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=32,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert [(c.function.name, c.function.arguments) for c in named.choices[0].message.tool_calls] == [
        ("get_time", "{}")
    ]


def test_every_json_schema_answer_parses_and_validates(api):
    """10 schemas x 5 sampled answers (5 choices each, four requests at a time: the servers batch them)."""
    client = _client(api)
    schemas = list(map(closed, SCHEMAS))

    def ask(job: tuple[int, int]) -> list[tuple[dict, str, str]]:
        k, seed = job
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schemas[k], "strict": True}}
        reply = client.chat.completions.create(
            model=MODEL,
            max_tokens=96,
            temperature=0.8,
            seed=seed,
            n=5,
            messages=[{"role": "user", "content": "Give an example record as JSON."}],
            response_format=fmt,
        )
        return [(schemas[k], c.finish_reason, c.message.content) for c in reply.choices]

    with ThreadPoolExecutor(4) as pool:
        answers = [a for got in pool.map(ask, [(k, 1) for k in range(10)]) for a in got]
    assert len(answers) == 50
    for schema, finish, content in answers:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), schema)
    anything = client.chat.completions.create(
        model=MODEL, max_tokens=64, temperature=0, messages=QUESTION, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_logit_bias_and_penalties_change_the_answer(api, reference):
    client = _client(api)
    plain = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=0
    )
    first = reference[1](plain.choices[0].logprobs.tokens[0], add_special_tokens=False)["input_ids"][0]
    banned = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=0,
    )
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    counting = "Count: 1, 1, 1, 1, 1, 1, 1,"
    repeat = client.completions.create(model=MODEL, prompt=counting, max_tokens=12, temperature=0)
    penalised = client.completions.create(
        model=MODEL, prompt=counting, max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert repeat.choices[0].text != penalised.choices[0].text


def test_embeddings_equal_the_local_models_pooled_hidden_states(api, reference):
    model, tokenizer = reference
    texts = ["Paris is the capital of France.", "A swarm of small machines."]
    reply = _client(api).embeddings.create(model=MODEL, input=texts)
    short = _client(api).embeddings.create(model=MODEL, input=texts[0], dimensions=32, encoding_format="base64")
    for text, item in zip(texts, reply.data, strict=True):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        want = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
        assert np.allclose(item.embedding, want.numpy(), atol=1e-4)
    got = np.frombuffer(base64.b64decode(short.data[0].embedding), "<f4")  # asked for: the client leaves it as text
    first = np.asarray(reply.data[0].embedding[:32])
    assert np.allclose(got, first / np.linalg.norm(first), atol=1e-5)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)


BASES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    "embeddings": ("/v1/embeddings", {"model": MODEL, "input": "Hi"}),
}


def test_every_row_of_the_conformance_table_is_answered_as_it_says(api):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=api.url, headers=headers, timeout=120) as http:
        for endpoint, fields in conformance.TABLE.items():
            path, base = BASES[endpoint]
            for f in fields:
                r = http.post(path, json={**base, **f.request()})
                if f.status == "refused":
                    assert r.status_code == 400 and r.json()["error"]["param"] == f.name, (endpoint, f.name, r.text)
                else:
                    assert r.status_code == 200, (endpoint, f.name, r.text)
                    if f.name == "tool_choice":  # required: the answer is a call (the walk's one deep check)
                        assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length"), r.text
                    assert '"error":' not in r.text, (endpoint, f.name, r.text)  # a stream's errors come as events
