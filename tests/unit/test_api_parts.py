"""The API's parts without a swarm: text released as tokens arrive (stop sequences, multi-byte characters),
sampling, request validation, the concurrency slots, and the HTTP layer's refusals (keys, body size, malformed or
hostile bodies always get an OpenAI-shaped 4xx, never a 500)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.api import errors
from swarm.api.app import create_app
from swarm.api.controls import ChoiceState, Controls
from swarm.api.limits import Limits, Slots
from swarm.api.runs import ApiState
from swarm.api.schema import ChatRequest, CompletionRequest
from swarm.api.text import TextStream
from tests.helpers.examples import fuzz_examples


class _Chars:
    """A tokenizer whose tokens are UTF-8 bytes: decoding a prefix may end inside a character."""

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def _stream(text: str, stops: tuple[str, ...]) -> tuple[list[str], bool]:
    s = TextStream(_Chars(), stops)  # type: ignore[arg-type]
    pieces, stopped = [], False
    for b in text.encode():
        piece, stopped = s.add(b)
        pieces.append(piece)
        if stopped:
            return pieces, True
    pieces.append(s.flush())
    return pieces, stopped


def test_text_is_released_only_when_final():
    pieces, stopped = _stream("Paris is nice. Lyon too", ("is n", "."))
    assert "".join(pieces) == "Paris " and stopped
    assert "".join(pieces[: len("Paris i")]) == "Pari"  # the last 3 characters could begin "is n": held back
    pieces, stopped = _stream("héllo wörld", ())
    assert "".join(pieces) == "héllo wörld" and not stopped
    assert all("\ufffd" not in p for p in pieces)  # half a character is never sent


def test_stop_across_pieces_and_at_the_start():
    assert _stream("abc###def", ("###",)) == (["", "", "a", "b", "c", ""], True)
    assert "".join(_stream("###", ("###",))[0]) == ""


def _pick(logits: torch.Tensor, c: Controls, rng: torch.Generator | None) -> list[int]:
    return [ChoiceState(c, i, logits.shape[1]).pick(row, 0, rng) for i, row in enumerate(logits)]


def test_pick_greedy_seeded_and_top_p():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 4.9]])
    assert _pick(logits, Controls(temperature=0.0), None) == [1, 0]
    draws = [_pick(logits, Controls(temperature=1.5), torch.Generator().manual_seed(3)) for _ in range(2)]
    assert draws[0] == draws[1]
    narrow = Controls(temperature=1.0, top_p=0.01)  # only the most likely token survives
    assert _pick(logits, narrow, torch.Generator().manual_seed(0)) == [1, 0]


def test_requests_are_bounded_and_unsupported_fields_named():
    with pytest.raises(ValueError, match="stop"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stop=["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError):
        ChatRequest(model="m", messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError):
        ChatRequest(model="m", messages=[], n=1)
    req = ChatRequest(
        model="m", messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}], store=True
    )
    assert req.messages[0].text() == "hi"
    assert req.unsupported() == "store"
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(ValueError, match="keys are token ids"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logit_bias={"hello": 1})
    with pytest.raises(ValueError, match="not among the tools"):
        ChatRequest(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    with pytest.raises(ValueError, match="needs echo"):
        CompletionRequest(model="m", prompt="x", max_tokens=0)
    assert CompletionRequest(model="m", prompt="x").requested_tokens() == 16  # OpenAI's default for completions
    assert ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stop="\n").stops() == ("\n",)


def test_slots_per_caller_and_in_total():
    slots = Slots(Limits(max_concurrent=3, max_client_concurrent=2))
    slots.acquire("a")
    slots.acquire("a")
    with pytest.raises(errors.ApiError, match="per caller"):
        slots.acquire("a")
    slots.acquire("b")
    with pytest.raises(errors.ApiError, match="retry later") as caught:
        slots.acquire("c")
    assert caught.value.status == 429
    slots.release("a")
    slots.acquire("c")
    assert slots.total == 3


@pytest.fixture(scope="module")
def http():
    state = ApiState({}, Limits(max_body_bytes=2048), keys=("secret-key-1",))
    with TestClient(create_app(state)) as client:
        yield client
    state.pool.shutdown()


AUTH = {"Authorization": "Bearer secret-key-1"}


def test_keys_body_limit_and_unknown_models(http):
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer nope-nope"}).json()["error"]["code"] == (
        "invalid_api_key"
    )
    assert http.get("/v1/models", headers=AUTH).json() == {"object": "list", "data": []}
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}
    r = http.post("/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    r = http.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}, headers=AUTH
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/nothing", headers=AUTH).json()["error"]["code"] == "not_found"
    assert "swarm_api_requests_total" in http.get("/metrics").text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values | st.just("m"),
        "messages": json_values,
        "prompt": json_values,
        "max_tokens": json_values,
        "temperature": json_values,
        "top_p": json_values,
        "stop": json_values,
        "n": json_values,
        "seed": json_values,
        "stream": json_values,
        "logprobs": json_values,
        "stream_options": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "response_format": json_values,
        "logit_bias": json_values,
        "top_logprobs": json_values,
        "echo": json_values,
        "input": json_values,
        "dimensions": json_values,
        "encoding_format": json_values,
    },
)


@settings(max_examples=fuzz_examples(150), deadline=None)
@given(
    body=fields | json_values,
    endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
)
def test_hostile_bodies_get_4xx_never_500(http, body, endpoint):
    r = http.post(endpoint, content=json.dumps(body), headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
