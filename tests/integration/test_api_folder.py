"""The HTTP API serving a model folder by its path (``python -m swarm.api --model ./tiny-chat``) over a real two-peer
swarm of a tiny Llama with a tokenizer of its own: the fast subset's API test (``test_api.py``, the official client
against the API's own process over SmolLM2, is the full one). A folder is served under the path it was given, while
its peers' records carry the folder's name: the API joins that swarm, answers as local Hugging Face does, and its
dashboard shows the swarm's peers (it once looked the swarm up by the served path, and showed none).

The API runs in this process, as ``python -m swarm.api`` builds it (its flags, ``Service``, app and dashboard), behind
FastAPI's test client: a process of its own would spend most of the test importing torch, transformers and hivemind
again."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.models import local_reference, make_tiny_model
from tests.helpers.swarms import running_swarm, wait_for

KEY = "folder-api-key"
VOCAB = 320


def tiny_chat_model(folder: Path) -> Path:
    """A tiny Llama with a word-level tokenizer of its own: ``<unk>``, ``<s>`` and ``</s>`` (the config's bos and eos
    ids 1 and 2), then the words ``w3`` ... ``w319``, so every token decodes to plain text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_tiny_model(folder, "llama", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def api(*argv: str) -> Iterator[Any]:
    """``python -m swarm.api ARGV --test-timings``, in this process: a test client of its app, dashboard attached."""
    from fastapi.testclient import TestClient

    from swarm.api.__main__ import build_parser
    from swarm.api.config import ApiConfig
    from swarm.api.service import Service
    from swarm.cli import from_args

    cfg = from_args(ApiConfig, build_parser().parse_args([*argv, "--test-timings"]))
    service = Service.start(cfg, cfg.limits.limits(), cfg.keys(), test_timings=True)
    try:
        app = service.app()
        service.attach_dashboard(app, lambda: False)
        with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as http:
            yield http
    finally:
        service.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("api-folder") / "tiny-chat")


def test_an_api_serving_a_folder_answers_and_shows_its_swarm(folder, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "w5 w17 w42 w99 w7"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = local_reference(folder).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in expected:  # the answer ends at the end of text
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
    monkeypatch.chdir(folder.parent)
    served = "./tiny-chat"  # as a user gives it; the peers were given the absolute path: the same model id
    with running_swarm(str(folder), ["0:2", "2:4"]) as swarm:
        args = ("--model", served, "--initial-peers", *swarm.initial_peers, "--codec", "none", "--api-key", KEY)
        with api(*args) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [served]
            body = {"model": served, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            reply = http.post("/v1/completions", json=body).json()
            assert reply["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
            assert reply["usage"]["completion_tokens"] == len(expected)
            assert [(h["start"], h["end"]) for h in reply["route"]] == [(0, 2), (2, 4)]
            peers = {p.peer_id for p in swarm.peers}

            def shown() -> bool:
                snapshot = http.get("/dashboard/state").json()["models"][served]
                return {p["peer_id"] for p in snapshot["peers"]} == peers and snapshot["covered"]

            wait_for(shown, 30, "the API's dashboard to show the swarm's two peers")


def test_an_api_with_a_drafter_answers_as_plain_decoding(folder):
    """``--draft``: speculative decoding behind the API. Greedy answers equal local Hugging Face's (the prompt
    repeats itself, so prompt lookup drafts), a streamed one too, sampled ones repeat with their seed, several
    choices decode plainly, a prompt sent again reuses the servers' kept prefix (``cached_tokens``); a drafter that
    cannot be loaded stops the API at start with the reason."""
    from transformers import AutoTokenizer

    from swarm.errors import BadInputError

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "w5 w17 w42 w99 w7 w5 w17 w42 w99 w7 w5 w17"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = local_reference(folder).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    with running_swarm(str(folder), ["0:2", "2:4"]) as swarm:
        base = ("--model", str(folder), "--initial-peers", *swarm.initial_peers, "--codec", "none", "--api-key", KEY)
        body = {"model": str(folder), "prompt": prompt, "max_tokens": 16, "temperature": 0}
        seeded = {**body, "temperature": 1.0, "top_p": 0.9, "seed": 3}
        with api(*base) as http:  # without a drafter: what a seed gives
            plain = [http.post("/v1/completions", json={**seeded, "seed": seed}).json() for seed in (3, 4)]
        for draft in ("ngram", "first:2"):
            with api(*base, "--draft", draft, "--draft-max", "4") as http:
                reply = http.post("/v1/completions", json=body).json()
                assert reply["choices"][0]["text"] == text, draft
                assert reply["usage"]["completion_tokens"] == len(expected)
                streamed = http.post("/v1/completions", json={**body, "stream": True}).text
                pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
                assert "".join(p["choices"][0]["text"] for p in pieces) == text
                # a seed gives the same text with a drafter as without, whatever the drafts were
                for want, seed in zip(plain, (3, 4), strict=True):
                    got = http.post("/v1/completions", json={**seeded, "seed": seed}).json()
                    assert got["choices"] == want["choices"], (draft, seed)
                two = http.post("/v1/completions", json={**seeded, "n": 2}).json()  # several choices: plainly
                assert len(two["choices"]) == 2 and two["choices"][0]["text"] == plain[0]["choices"][0]["text"]
            # the servers kept what a speculative answer's session computed: the same long prompt again reuses its
            # whole blocks, and says so as OpenAI does
            with api(*base, "--draft", draft, "--draft-max", "4", "--keep-sessions", "0") as http:
                long = {**body, "prompt": " ".join(f"w{i % 50}" for i in range(90))}
                first, again = (http.post("/v1/completions", json=long).json() for _ in range(2))
                assert first["usage"]["prompt_tokens"] >= 64 and first["choices"] == again["choices"], draft
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                whole = 64 * (first["usage"]["prompt_tokens"] // 64)  # the prompt's whole blocks
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == whole, draft
        with pytest.raises(BadInputError, match="first:9"):
            with api(*base, "--draft", "first:9"):
                pass
