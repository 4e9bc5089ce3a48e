"""A swarm of peers started by a Hub name (``--model ORG/NAME``, issue 58), against a local server speaking the Hub's
file API (``harness/fake_hub.py``, ``HF_ENDPOINT``) that serves the tiny Llama's folder: two servers and a client
share one cache, each fetching only the shards holding what it reads (a server its span's, the client its
embeddings', norm's and head's), each weight file crossing the network once, and greedy generation equals the local
Hugging Face run of the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.fake_hub import FakeHub
from swarm.hub import INDEX, shards_for
from swarm.launch import LocalSwarm
from tests.helpers.swarms import TEST_SERVER_ARGS, connect

pytestmark = pytest.mark.slow  # peers started as processes of their own (the fork server's environment has no hub)

REPO = "acme/tiny-llama"


def test_a_swarm_of_hub_named_peers_answers_as_hugging_face(folder, ref, tmp_path, monkeypatch):
    torch.manual_seed(11)
    ids = torch.randint(0, 320, (1, 9))
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    with FakeHub() as hub:
        commit = hub.add(REPO, Path(folder))
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
        for key, value in env.items():  # the client, in this process, reads them when it loads the model
            monkeypatch.setenv(key, value)
        for key in ("HF_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(key, raising=False)
        swarm = LocalSwarm(
            REPO, ["0:2"], extra_args=TEST_SERVER_ARGS, test_timings=True, env=env, log_dir=tmp_path / "logs"
        )
        index = json.loads((Path(folder) / INDEX).read_text())["weight_map"]
        weights = lambda: {p for p in hub.sent_for(REPO) if p.endswith(".safetensors")}  # noqa: E731
        with swarm:
            first = shards_for(index, ["model.layers.0.", "model.layers.1."])
            assert weights() == first  # the first server: the shards of its span, no others
            swarm.add_peer("2:4")
            second = first | shards_for(index, ["model.layers.2.", "model.layers.3."])
            assert weights() == second
            with connect(REPO, swarm) as client:
                out = client.generate(ids, max_new_tokens=8, do_sample=False)
                assert {h.peer_id for h in client.route} == {p.peer_id for p in swarm.peers}
                view = client.connection.store.view(REPO, 4)
                assert {r.revision for rs in view.values() for r in rs} == {commit}  # what swarm.status prints
            client_modules = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
            assert weights() == second | shards_for(index, [], client_modules)
        sent = hub.sent_for(REPO)
    assert torch.equal(out, expected)
    for name in weights():  # one shared cache: each file once, whoever asked first (the others wait on its lock)
        assert sent[name] == (Path(folder) / name).stat().st_size, (name, sent[name])
