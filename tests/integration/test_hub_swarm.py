"""A swarm of peers started by a Hub name (``--model ORG/NAME``, issue 58), against a local server speaking the Hub's
file API (``harness/fake_hub.py``, ``HF_ENDPOINT``) that counts the bytes it sends. It serves SmolLM2-135M saved as
the issue names it, six shards of five blocks each (the embeddings in the first, the final norm in the last): a
server of blocks 10:20 downloads its two shards, at most a third of the weights' bytes; the servers of 0:10 and
20:30, sharing its cache, add only their own (each weight file crosses the network once); a client naming the model
the same way, with a cache of its own, downloads only the shards holding its embeddings, final norm and head; and
greedy generation through the three equals the local Hugging Face run of the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness.fake_hub import FakeHub
from swarm.hub import INDEX, shards_for
from swarm.launch import LocalSwarm
from tests.helpers.models import local_reference
from tests.helpers.swarms import TEST_SERVER_ARGS, connect

pytestmark = pytest.mark.slow  # peers started as processes of their own (the fork server's environment has no hub)

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHARDS = 6
BLOCKS_PER_SHARD = 5
CLIENT_MODULES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def _shard_of(name: str) -> int:
    """Block ``b``'s tensors in shard ``b // 5``, the embeddings in the first, everything else in the last."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // BLOCKS_PER_SHARD
    return 0 if name.startswith("model.embed_tokens.") else SHARDS - 1


@pytest.fixture(scope="module")
def six_shards(smollm_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm-six-shards")
    index = json.loads((smollm_folder / INDEX).read_text())["weight_map"]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(SHARDS)]
    for file in sorted(set(index.values())):
        with safe_open(str(smollm_folder / file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                groups[_shard_of(name)][name] = f.get_tensor(name)
    names = [f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors" for k in range(SHARDS)]
    for name, tensors in zip(names, groups, strict=True):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    weight_map = {t: names[k] for k, group in enumerate(groups) for t in group}
    total = sum(t.numel() * t.element_size() for group in groups for t in group.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    for path in smollm_folder.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX:
            shutil.copy(path, out / path.name)
    return out


def test_a_swarm_of_hub_named_peers_downloads_only_its_shards_and_answers_as_hugging_face(
    six_shards, tmp_path, monkeypatch
):
    torch.manual_seed(11)
    ids = torch.randint(0, 49152, (1, 9))
    expected = local_reference(six_shards).generate(ids, max_new_tokens=6, do_sample=False)
    index = json.loads((six_shards / INDEX).read_text())["weight_map"]
    size = {f: (six_shards / f).stat().st_size for f in set(index.values())}
    blocks = lambda a, b: [f"model.layers.{i}." for i in range(a, b)]  # noqa: E731
    with FakeHub() as hub:
        commit = hub.add(REPO, six_shards)
        sent = lambda: {p: n for p, n in hub.sent_for(REPO).items() if p.endswith(".safetensors")}  # noqa: E731
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "servers-cache")}
        for key in ("HF_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(key, raising=False)
        swarm = LocalSwarm(
            REPO, ["10:20"], extra_args=TEST_SERVER_ARGS, test_timings=True, env=env, log_dir=tmp_path / "logs"
        )
        with swarm:
            middle = shards_for(index, blocks(10, 20))
            assert len(middle) == 2 and set(sent()) == middle  # ``swarm.serve --blocks 10:20``: its shards alone
            assert sum(sent().values()) <= sum(size.values()) / 3, (sent(), size)
            for peer in [swarm.add_peer(span, wait=False) for span in ("0:10", "20:30")]:  # started together
                peer.wait_ready(swarm.startup_timeout)
            servers = set(index.values())  # together they read every shard, each once in their shared cache
            assert set(sent()) == servers and sent() == {f: size[f] for f in servers}
            monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the client, in this process, reads them when it loads
            monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "client-cache"))
            before = hub.sent_for(REPO)
            with connect(REPO, swarm) as client:
                fetched = {p: n - before.get(p, 0) for p, n in sent().items() if n > before.get(p, 0)}
                own = shards_for(index, [], CLIENT_MODULES)
                assert set(fetched) == own and own == {index["model.embed_tokens.weight"], index["model.norm.weight"]}
                assert fetched == {f: size[f] for f in own}
                out = client.generate(ids, max_new_tokens=6, do_sample=False)
                assert {h.peer_id for h in client.route} == {p.peer_id for p in swarm.peers}
                view = client.connection.store.view(REPO, 30)
                assert {r.revision for rs in view.values() for r in rs} == {commit}  # what swarm.status prints
    assert torch.equal(out, expected)
