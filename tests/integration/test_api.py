"""``python -m swarm.api`` over a real loopback swarm serving SmolLM2-135M-Instruct, driven by the official ``openai``
client: answers equal local Hugging Face's greedy generation, streamed and not; limits, errors and disconnects as
OpenAI's clients expect them. The tests that kill a server run last, in their own module order."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch

from harness.local_swarm import ApiProcess
from swarm.hop import Hop
from tests.helpers.models import local_reference
from tests.helpers.swarms import connect, counter, running_swarm, scrape, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY, OTHER_KEY = "test-key-one", "test-key-two"
MAX_TOKENS, CONTEXT = 48, 160
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# a greedy answer longer than MAX_TOKENS: streams that must still be running when the test acts on them
LONG = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
# Every server answers each request or step 50 ms late: an answer of MAX_TOKENS tokens through both takes at least
# 48 x 2 x 50 ms = 4.8 s on any machine, however fast, so a client that leaves as soon as its answer is under way
# leaves in the middle of it. Their metrics count what happened to them (steps, sessions that idled out).
SERVER_ARGS = ("--added-latency-ms", "50", "--metrics-port", "0")
HANG_S = 60  # how long the tests wait for something that happens in well under a second (a bound on a hang only)


@pytest.fixture(scope="module")
def stack(smollm_folder):
    with running_swarm(MODEL, ["0:15", "15:30"], *SERVER_ARGS) as swarm:
        args = (
            "--model",
            MODEL,
            "--api-key",
            KEY,
            "--api-key",
            OTHER_KEY,
            "--codec",
            "none",
            "--max-concurrent",
            "3",
            "--max-client-concurrent",
            "2",
            "--max-tokens-limit",
            str(MAX_TOKENS),
            "--max-body-kb",
            "16",
            "--max-context",
            str(CONTEXT),
        )
        with ApiProcess(swarm.initial_peers, *args) as api:
            watcher = connect(MODEL, swarm)  # reads the servers' own cache room
            try:
                yield swarm, api, watcher
            finally:
                watcher.close()


@pytest.fixture(scope="module")
def reference(smollm_folder):
    from swarm import load_tokenizer

    return local_reference(smollm_folder), load_tokenizer(MODEL)


def _client(api: ApiProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _greedy(reference, ids: list[int], n: int) -> tuple[str, int]:
    model, tokenizer = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in out:
        out = out[: out.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def _cache_free(watcher) -> dict[str, tuple[int, int]]:
    conn = watcher.connection
    out = {}
    for r in conn.view.servers():
        info = conn.loop.run(conn.remote.info(Hop.of(r), 5.0))
        out[r.peer_id] = (info.cache_tokens_free, r.cache_tokens_total)
    return out


def _has_content(line: str) -> bool:
    return line.startswith("data: {") and bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))


def _all_free(watcher) -> bool:
    return all(free == total for free, total in _cache_free(watcher).values())


def test_models_lists_what_the_swarm_covers(stack):
    _, api, _ = stack
    client = _client(api)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_equals_local_greedy_generation(stack, reference):
    _, api, _ = stack
    ids = reference[1].apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected, generated = _greedy(reference, list(ids["input_ids"]), 12)
    reply = _client(api).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids["input_ids"]) and reply.usage.completion_tokens == generated
    assert reply.choices[0].finish_reason == ("stop" if generated < 12 else "length")
    route = reply.model_extra["route"]
    assert [(h["start"], h["end"]) for h in route] == [(0, 15), (15, 30)]
    assert {(h["dtype"], h["quantization"]) for h in route} == {("float32", "none")}  # what each hop computes in


def test_a_conversation_s_next_turn_goes_on_from_the_kept_session(stack, reference):
    """OpenAI clients send the whole history at every turn: the API kept the first turn's session open on the
    servers, so the second turn sends and computes only what is new (``usage.prompt_tokens_details.cached_tokens``:
    the first turn's prompt and answer, as the servers held them), and its answer equals local Hugging Face's greedy
    one over the whole history. Another caller (another key) reuses nothing and gets the same answer. (Both turns'
    local answers are worked out first: the kept session is closed after ``--keep-idle``, 2.5 s with the tests'
    timings, and only the requests themselves come between the turns.)"""
    _, api, _ = stack
    model, tokenizer = reference
    client = _client(api)

    def tokens(messages: list[dict[str, str]]) -> list[int]:
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(chat["input_ids"])

    answer, _ = _greedy(reference, tokens(QUESTION), 8)
    history = [*QUESTION, {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    ids = tokens(history)
    expected, _ = _greedy(reference, ids, 8)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert first.choices[0].message.content == answer and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == expected
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < len(ids) == second.usage.prompt_tokens
    other = _client(api, OTHER_KEY).chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert other.choices[0].message.content == expected and other.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_is_the_same_answer_with_usage_and_route(stack, reference):
    _, api, _ = stack
    client = _client(api)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it came in pieces
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert [(h["start"], h["end"]) for h in last.model_extra["route"]] == [(0, 15), (15, 30)]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_stop_seed_and_n(stack, reference):
    _, api, _ = stack
    client = _client(api)
    prompt = "The capital of France is"
    ids = reference[1](prompt)["input_ids"]
    expected, _ = _greedy(reference, list(ids), 8)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected
    assert "." in expected
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=["."])
    assert stopped.choices[0].text == expected[: expected.index(".")]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, top_p=0.9, seed=7, n=2)
        for _ in range(2)
    ]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]  # seeded: repeatable
    assert len(sampled[0].choices) == 2 and sampled[0].usage.completion_tokens <= 12


def test_requests_at_once_and_the_concurrency_limits(stack):
    _, api, _ = stack
    one, two = _client(api), _client(api, OTHER_KEY)
    alone = one.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    answers: list[str | None] = []

    def ask(client: openai.OpenAI) -> None:
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
        answers.append(reply.choices[0].message.content)

    threads = [threading.Thread(target=ask, args=(c,)) for c in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [alone.choices[0].message.content] * 2
    # Streams hold their slots until they end: two of one caller, then one of another fill the server's three.
    held = [
        one.chat.completions.create(model=MODEL, messages=LONG, max_tokens=MAX_TOKENS, stream=True, temperature=0)
        for _ in range(2)
    ]
    try:
        with pytest.raises(openai.RateLimitError, match="per caller"):
            one.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
        held.append(
            two.chat.completions.create(model=MODEL, messages=LONG, max_tokens=MAX_TOKENS, stream=True, temperature=0)
        )
        with pytest.raises(openai.RateLimitError, match="retry later"):
            two.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    finally:
        for stream in held:
            stream.close()
    wait_for(lambda: _try(two), HANG_S, "a slot freed by the closed streams")


def _try(client: openai.OpenAI) -> bool:
    try:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        return True
    except openai.RateLimitError:
        return False


def test_errors_are_openai_shaped(stack):
    _, api, _ = stack
    client = _client(api)
    with pytest.raises(openai.AuthenticationError):
        _client(api, "wrong-key-123").models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort is not supported"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="low")
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_TOKENS}"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS + 1)
    long = [{"role": "user", "content": "Paris " * 150}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=8)
    assert caught.value.code == "context_length_exceeded"
    huge = [{"role": "user", "content": "x" * 20_000}]
    with pytest.raises(openai.BadRequestError, match="bytes"):
        client.chat.completions.create(model=MODEL, messages=huge, max_tokens=8)
    raw = httpx.post(
        api.url + "/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def _outcomes(api: ApiProcess) -> dict[str, float]:
    """The API's own count of chat requests, by outcome."""
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in scrape(api.url + "/metrics").items()
        if name == "swarm_api_requests_total" and dict(labels)["endpoint"] == "chat"
    }


def _steps(swarm) -> float:
    """Inference steps the servers have taken, all together (their own count)."""
    kind = (("kind", "inference_step"), ("outcome", "ok"))
    return sum(scrape(p.urls["metrics"]).get(("swarm_peer_requests_total", kind), 0.0) for p in swarm.peers)


def _post(url: str, body: dict) -> socket.socket:
    """A chat request on a plain socket, whose closing is the client going away (nothing else reads or closes it)."""
    where = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((where.hostname, where.port), timeout=HANG_S)
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_the_servers_caches(stack, stream):
    """The client leaves once its answer is under way (seen in the stream, or in the servers' step counts), seconds
    before the answer could end (``SERVER_ARGS``). The API must notice, stop the generation and close its sessions:
    it counts the request as ``client_closed``, never ``ok``; the servers took fewer steps than the whole answer needs,
    and their caches come free without a session idling out (which would free them too, a few seconds later)."""
    swarm, api, watcher = stack
    assert wait_for(lambda: _all_free(watcher), HANG_S, "idle servers")
    before, steps = _outcomes(api), _steps(swarm)
    expired = sum(counter(swarm, "swarm_peer_sessions_expired").values())
    body = {"model": MODEL, "messages": LONG, "max_tokens": MAX_TOKENS, "stream": stream, "temperature": 0}
    if stream:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=HANG_S) as http:
            with http.stream("POST", api.url + "/v1/chat/completions", json=body, headers=headers) as r:
                lines = r.iter_lines()  # kept: a dropped line iterator closes the response, as a client going away
                while not _has_content(next(lines)):
                    pass  # until the answer flows; leaving the block closes the connection
    else:
        with _post(api.url, body):
            wait_for(lambda: _steps(swarm) > steps, HANG_S, "the answer under way")
    closed = before.get("client_closed", 0) + 1
    wait_for(lambda: _outcomes(api).get("client_closed", 0) == closed, HANG_S, "the API to count it client_closed")
    wait_for(lambda: _all_free(watcher), HANG_S, "the caches freed")
    assert _outcomes(api).get("ok", 0) == before.get("ok", 0)  # the answer was never finished
    # each server takes a step per token: a whole answer is the prompt's step(s) and MAX_TOKENS - 1 more on each
    assert _steps(swarm) - steps < 2 * (MAX_TOKENS - 1)
    # freed by the API closing its sessions, not by the servers ending sessions that went quiet
    assert sum(counter(swarm, "swarm_peer_sessions_expired").values()) == expired


def test_swarm_failures_mid_stream_and_before(stack):
    swarm, api, _ = stack
    client = _client(api)
    stream = client.chat.completions.create(
        model=MODEL, messages=LONG, max_tokens=MAX_TOKENS, stream=True, temperature=0
    )
    with pytest.raises(openai.APIError) as failed:
        for i, _chunk in enumerate(stream):
            if i == 2:  # the only server of blocks 15:30 dies: nobody can take over
                swarm.kill(swarm.peers[1])
    assert failed.value.code == "swarm_unavailable"  # the stream's error event, as the API names it
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert caught.value.status_code == 503
    assert wait_for(lambda: not client.models.list().data, HANG_S, "the model leaving /v1/models")


def test_metrics_count_what_happened(stack):
    """The module's last test: ``/metrics`` (read with Prometheus' own parser) counts what the tests above did to this
    API (the module fixture's): answers, each refusal, a client gone, a failover, the bytes its clients moved."""
    _, api, _ = stack
    samples = scrape(api.url + "/metrics")

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("swarm_api_requests_total", endpoint="chat", outcome="ok") >= 5
    for outcome in ("not_found", "bad_request", "too_many", "context_too_long", "unavailable", "client_closed"):
        assert value("swarm_api_requests_total", endpoint="chat", outcome=outcome) >= 1, outcome
    assert value("swarm_api_requests_total", endpoint="models", outcome="unauthorized") >= 1
    assert value("swarm_api_tokens_generated_total", endpoint="chat") > 0
    assert value("swarm_api_time_to_first_token_seconds_count", endpoint="chat") > 0
    assert value("swarm_api_failovers_total") >= 1
    assert value("swarm_api_requests_in_flight") == 0
    moved = [v for (name, _), v in samples.items() if name == "swarm_api_swarm_bytes_total"]
    assert moved and min(moved) > 0
