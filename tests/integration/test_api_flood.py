"""``python -m swarm.api`` with an API key, over a real loopback swarm serving SmolLM2-135M-Instruct, while 500
sockets without the key sit on it: silent, half a request line then silence, a header trickled a byte at a time, and
the dashboard's event stream asked for without a key. The key holder's answers still equal local Hugging Face's
greedy generation, streamed and not, and the dashboard opens for it (Bearer header, or the browser's login form and
cookie); without the key the pages, state and event stream are refused (401) and nothing public names a peer.

Outcomes are asserted, not durations: the head and keep-alive deadlines are set beyond any wait here, so the flood
stays until the test itself pushes it out (a new connection cuts the oldest pending one), and each wait is a bound
on a hang only."""

from __future__ import annotations

import json
import resource
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.local_swarm import ApiProcess
from tests.helpers.models import local_reference
from tests.helpers.swarms import closed_by_peer, running_swarm, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "flood-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
PENDING = 256  # the API's default --max-pending-connections
SILENT, HALF, TRICKLE, STREAMS = 150, 100, 150, 100  # the flood, opened in this order (500 sockets)
HANG_S = 60.0  # the API's head and keep-alive deadlines too: no flood socket times out while the test runs
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FD_SOFT = 4096  # the flood, the sockets that push it out, and the usual: beyond a default soft limit of 1024


class Flood:
    """The outsiders' sockets, opened oldest first, with a thread trickling a byte to each trickler every half
    second (pacing, not synchronization: the test waits on what the server did)."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.silent = [self._open(b"") for _ in range(SILENT)]
        self.half = [self._open(b"GET /v1/mod") for _ in range(HALF)]
        self.tricklers = [self._open(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(TRICKLE)]
        request = b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n"
        self.streams = [self._open(request) for _ in range(STREAMS)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    @property
    def all(self) -> list[socket.socket]:
        return self.silent + self.half + self.tricklers + self.streams

    def _open(self, first: bytes) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=HANG_S)
        if first:
            sock.sendall(first)
        return sock

    def _trickle(self) -> None:
        while not self._stop.wait(0.5):
            for sock in self.tricklers:
                try:
                    sock.send(b"a", socket.MSG_DONTWAIT)
                except OSError:
                    pass  # cut by the server, or its buffer full: the next round tries again

    def close(self) -> None:
        self._stop.set()
        self._thread.join(HANG_S)
        for sock in self.all:
            sock.close()


def _status(sock: socket.socket) -> bytes:
    """The status line of the one response ``sock`` is owed."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def _metric(api: ApiProcess, name: str, **labels: str) -> float:
    """One sample of the API's metrics, asked for with the key (a key holder's request, never refused for the
    outsiders' pool being full, and its connection never pending)."""
    text = httpx.get(api.url + "/metrics", headers=BEARER, timeout=HANG_S).raise_for_status().text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


@pytest.fixture(scope="module")
def stack(smollm_folder) -> Iterator[tuple[object, ApiProcess]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FD_SOFT:  # the API inherits it too
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(FD_SOFT, hard), hard))
    try:
        with running_swarm(MODEL, ["0:30"]) as swarm:
            args = ("--model", MODEL, "--api-key", KEY, "--codec", "none")
            deadlines = ("--header-timeout", str(HANG_S), "--keep-alive-timeout", str(HANG_S))
            with ApiProcess(swarm.initial_peers, *args, *deadlines) as api:
                yield swarm, api
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def reference(smollm_folder):
    from swarm import load_tokenizer

    return local_reference(smollm_folder), load_tokenizer(MODEL)


def _greedy(reference, n: int) -> str:
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = list(ids["input_ids"])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
    if tokenizer.eos_token_id in out:
        out = out[: out.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(out, skip_special_tokens=True)


def _shown_peers(state: dict) -> set[str]:
    return {p["peer_id"] for p in state["models"][MODEL]["peers"]}


def _first_event(client: httpx.Client, url: str, **kwargs: object) -> dict:
    with client.stream("GET", url + "/dashboard/events", **kwargs) as reply:  # type: ignore[arg-type]
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("the event stream ended without an event")


def test_key_holders_are_served_through_a_flood_of_outsiders(stack, reference):
    swarm, api = stack
    split = urlsplit(api.url)
    flood = Flood(split.hostname or "127.0.0.1", split.port or 80)
    fresh: list[socket.socket] = []
    try:
        # the server holds as many connections without a key as it takes, the flood's newest (but the one the
        # scrape's own connection pushed out before it showed its key)
        full = lambda: _metric(api, "swarm_api_connections", state="pending") == PENDING - 1  # noqa: E731
        wait_for(full, HANG_S, "the pool of pending connections to be full")
        # the event stream without a key: refused, 401, or 503 while the outsiders' pool is full of its own (the
        # first one finds it empty)
        statuses = [_status(sock)[9:12] for sock in flood.streams]
        assert set(statuses) <= {b"401", b"503"} and statuses[0] == b"401", set(statuses)

        client = openai.OpenAI(base_url=api.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        expected = _greedy(reference, 12)
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == expected
        chunks = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected

        servers = {p.peer_id for p in swarm.peers}
        with httpx.Client(base_url=api.url, headers=BEARER, timeout=HANG_S) as holder:
            shown = lambda: _shown_peers(holder.get("/dashboard/state").json()) == servers  # noqa: E731
            wait_for(shown, HANG_S, "the dashboard to show the swarm's server")
            assert _shown_peers(_first_event(holder, api.url)) == servers
            assert holder.get("/dashboard").status_code == 200

        # what the flood cost: the oldest were cut as newer came; the rest go as new connections push them out
        wait_for(lambda: all(closed_by_peer(s) for s in flood.silent), HANG_S, "the oldest to be cut")
        fresh = [socket.create_connection(flood.address, timeout=HANG_S) for _ in range(PENDING)]
        wait_for(lambda: all(closed_by_peer(s) for s in flood.all), HANG_S, "every flood socket to be cut")
        cut = sum(_metric(api, "swarm_api_connections_cut_total", reason=r) for r in ("evicted", "header_timeout"))
        assert cut >= SILENT + HALF + TRICKLE + STREAMS
    finally:
        flood.close()
        for sock in fresh:
            sock.close()


def test_the_dashboard_is_the_key_holders_only(stack):
    swarm, api = stack
    private = [p.peer_id for p in swarm.peers] + list(swarm.initial_peers)
    with httpx.Client(base_url=api.url, timeout=HANG_S) as outsider:
        for path in ("/dashboard", "/chat"):
            page = outsider.get(path)
            assert page.status_code == 401 and '<form method="post">' in page.text
            assert outsider.post(path, data={"key": "not-the-key"}).status_code == 401
        assert outsider.get("/dashboard/state").status_code == 401
        with outsider.stream("GET", "/dashboard/events") as events:
            assert events.status_code == 401
        public = [outsider.get(p) for p in ("/health", "/metrics", "/static/dashboard.js", "/dashboard", "/chat")]
        assert all(p not in reply.text for p in private for reply in public)
        assert outsider.get("/v1/models").status_code == 401

    with httpx.Client(base_url=api.url, timeout=HANG_S) as browser:  # the login form, as a browser posts it
        login = browser.post("/dashboard", data={"key": KEY})
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and KEY not in cookie
        assert browser.get("/dashboard").status_code == 200 and browser.get("/chat").status_code == 200
        assert _shown_peers(browser.get("/dashboard/state").json()) == {p.peer_id for p in swarm.peers}
        assert _shown_peers(_first_event(browser, api.url)) == {p.peer_id for p in swarm.peers}
        assert browser.get("/v1/models").status_code == 401  # the cookie opens the dashboard, not the API
