"""Models by Hub names (``swarm/hub.py``) against a local server speaking the Hub's file API (``harness/fake_hub.py``)
that serves a real checkpoint split into shards and counts the bytes it sends: a span downloads only the shards
holding its blocks, a corrupted file is refused and fetched again, an interrupted download resumes, a gated model
without its token fails naming the model, two revisions resolve to two commits, the disk's space is checked first,
and offline mode reads the cache alone."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.fake_hub import FakeHub
from swarm.config import load_model_card
from swarm.errors import BadInputError
from swarm.hub import ALWAYS, INDEX, HubName, HubSettings, fetch, resolve, shards_for, use_token
from swarm.serve import build_parser
from tests.helpers.models import make_tiny_model

REPO = "acme/tiny-llama"


def _save(folder: Path, seed: int) -> Path:
    return make_tiny_model(folder, "llama", seed=seed, perturb=0.02)  # saved in several shards


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-models")
    return _save(root / "v1", 0), _save(root / "v2", 1)


@pytest.fixture
def hub(checkpoints, tmp_path):
    with FakeHub() as server:
        server.add(REPO, checkpoints[0])
        server.add(REPO, checkpoints[1], revision="v2")
        server.add("acme/gated", checkpoints[0], token="s3cret")
        server.settings = HubSettings(endpoint=server.url, cache_dir=tmp_path / "hf-cache")  # type: ignore[attr-defined]
        yield server


def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def test_names_parse_and_folders_are_not_names(tmp_path):
    assert HubName.parse("Qwen/Qwen3-8B") == HubName("Qwen/Qwen3-8B", "main")
    assert HubName.parse("meta-llama/Llama-3.1-70B-Instruct@v1.0") == HubName(
        "meta-llama/Llama-3.1-70B-Instruct", "v1.0"
    )
    assert HubName.parse("smollm2-135m") is None  # a model card's name
    (tmp_path / "org" / "folder").mkdir(parents=True)
    assert HubName.parse(str(tmp_path / "org" / "folder")) is None
    assert HubName.parse("a/b/c") is None and HubName.parse("../x") is None


def test_a_span_downloads_only_the_shards_holding_its_blocks(hub, checkpoints):
    resolved = resolve(HubName(REPO), hub.settings)
    folder = fetch(resolved, [], hub.settings, optional=ALWAYS)  # config, tokenizer if any, the index: no weights
    index = _weight_map(folder)
    assert len(set(index.values())) >= 4  # a real split
    wanted = shards_for(index, ["model.layers.2."])
    assert wanted and wanted != set(index.values())
    folder = fetch(resolved, wanted, hub.settings)
    sent = hub.sent_for(REPO)
    weights_sent = {p for p in sent if p.endswith(".safetensors")}
    assert weights_sent == wanted  # only the shards holding block 2
    original = checkpoints[0]
    assert sum(sent.values()) == sum((original / p).stat().st_size for p in sent)  # each once, whole
    for shard in wanted:  # the same tensors as the model folder's
        mine, theirs = load_file(folder / shard), load_file(original / shard)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    before = dict(hub.sent)
    fetch(resolved, wanted, hub.settings)  # already here, checked: nothing sent again
    assert dict(hub.sent) == before


def test_a_fetch_logs_one_progress_line_per_file_which_json_logs_carry(hub, caplog):
    from swarm.logs import JsonFormatter

    resolved = resolve(HubName(REPO), hub.settings)
    shards = sorted(f for f in resolved.files if f.endswith(".safetensors"))[:3]
    with caplog.at_level("INFO", logger="swarm.hub"):
        fetch(resolved, shards, hub.settings)
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if hasattr(r, "progress")]
    total = sum(resolved.files[f].size for f in shards)
    assert [line["progress"]["files"] for line in lines] == [[1, 3], [2, 3], [3, 3]]
    assert lines[-1]["progress"]["bytes"] == [total, total] and lines[-1]["kind"] == "download"
    assert [line["progress"]["file"] for line in lines] == shards


def test_a_corrupted_file_is_refused_and_fetched_again(hub, checkpoints):
    resolved = resolve(HubName(REPO), hub.settings)
    shard = sorted(f for f in resolved.files if f.endswith(".safetensors"))[0]
    hub.corrupt(REPO, shard, times=1)
    folder = fetch(resolved, [shard], hub.settings)
    assert (folder / shard).read_bytes() == (checkpoints[0] / shard).read_bytes()
    assert hub.sent_for(REPO)[shard] == 2 * resolved.files[shard].size  # the corrupted copy, then a good one
    other = sorted(f for f in resolved.files if f.endswith(".safetensors"))[1]
    hub.corrupt(REPO, other, times=2)
    with pytest.raises(BadInputError, match=f"{other} does not match the sha256 the Hub lists, twice"):
        fetch(resolved, [other], hub.settings)
    assert not (folder / other).exists()  # nothing half-right is left to read


def test_an_interrupted_download_resumes(hub, checkpoints):
    resolved = resolve(HubName(REPO), hub.settings)
    shard = max((f for f in resolved.files if f.endswith(".safetensors")), key=lambda f: resolved.files[f].size)
    size = resolved.files[shard].size
    hub.cut(REPO, shard, after=size // 2)
    folder = fetch(resolved, [shard], hub.settings)
    assert (folder / shard).read_bytes() == (checkpoints[0] / shard).read_bytes()
    assert hub.sent_for(REPO)[shard] < 2 * size  # the second request took up where the first stopped


def test_a_gated_model_needs_its_token_and_the_error_names_it(hub):
    with pytest.raises(BadInputError, match="acme/gated is gated.*HF_TOKEN"):
        resolve(HubName("acme/gated"), hub.settings)
    settings = HubSettings(hub.settings.endpoint, hub.settings.cache_dir, token="s3cret")
    resolved = resolve(HubName("acme/gated"), settings)
    assert (fetch(resolved, ["config.json"], settings) / "config.json").is_file()
    with pytest.MonkeyPatch.context() as env:  # ``--token`` on swarm.serve, swarm.api and swarm.train
        env.setenv("HF_TOKEN", "")  # put back as it was (absent) when the context ends
        args = build_parser().parse_args(["--token", "s3cret"])
        use_token(args.token)
        assert HubSettings.from_env().token == "s3cret"
    with pytest.raises(BadInputError, match="acme/nothing: not found on the Hub"):
        resolve(HubName("acme/nothing"), hub.settings)
    with pytest.raises(BadInputError, match="no revision 'v9'"):
        resolve(HubName(REPO, "v9"), hub.settings)


def test_two_revisions_are_two_commits_with_their_own_weights(hub, checkpoints):
    one, two = resolve(HubName(REPO), hub.settings), resolve(HubName(REPO, "v2"), hub.settings)
    assert one.commit != two.commit
    shard = sorted(f for f in one.files if f.endswith(".safetensors"))[0]
    a, b = fetch(one, [shard], hub.settings), fetch(two, [shard], hub.settings)
    assert a != b
    assert (b / shard).read_bytes() == (checkpoints[1] / shard).read_bytes() != (a / shard).read_bytes()


def test_disk_space_is_checked_before_anything_is_fetched(hub, monkeypatch):
    resolved = resolve(HubName(REPO), hub.settings)
    shards = [f for f in resolved.files if f.endswith(".safetensors")]
    need = sum(resolved.files[f].size for f in shards)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12, need - 1))
    with pytest.raises(BadInputError, match=f"{len(shards)} files need .* GB .* free"):
        fetch(resolved, shards, hub.settings)
    assert not any(p.endswith(".safetensors") for p in hub.sent_for(REPO))


def test_offline_reads_the_cache_alone(checkpoints, tmp_path):
    with FakeHub() as server:
        server.add(REPO, checkpoints[0])
        online = HubSettings(endpoint=server.url, cache_dir=tmp_path / "hf-cache")
        resolved = resolve(HubName(REPO), online)
        fetch(resolved, ["config.json", INDEX], online)
    offline = HubSettings(endpoint="http://127.0.0.1:9", cache_dir=online.cache_dir, offline=True)
    again = resolve(HubName(REPO), offline)  # the server is gone: the cache's record of main
    assert again.commit == resolved.commit
    assert (fetch(again, ["config.json"], offline) / "config.json").is_file()
    shard = next(f for f in resolved.files if f.endswith(".safetensors"))
    with pytest.raises(BadInputError, match=f"no {shard} in the local cache"):
        fetch(again, [shard], offline)
    with pytest.raises(BadInputError, match="has no nothing.bin at commit"):
        fetch(resolved, ["nothing.bin"], online)


def test_a_hub_name_is_a_model_card_whose_folder_has_the_local_folder_s_fingerprint(hub, checkpoints, monkeypatch):
    """``--model ORG/NAME[@REVISION]``: the whole model fetched and checked (every shard its index names), read as
    any model folder; the same files as a local folder give the same fingerprint, another revision another one."""
    from swarm.model_files import load_config, model_folder, weights_fingerprint

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.settings.cache_dir))
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    card = load_model_card(REPO)
    assert (card.kind, card.name, card.hub) == ("hub", REPO, REPO)
    folder = model_folder(card, hub.settings.cache_dir)
    assert load_config(folder).num_hidden_layers == 4
    cache = hub.settings.cache_dir / "fingerprints"
    local = weights_fingerprint(checkpoints[0], "float32", cache)
    assert weights_fingerprint(folder, "float32", cache) == local
    other = model_folder(load_model_card(f"{REPO}@v2"), hub.settings.cache_dir)
    assert weights_fingerprint(other, "float32", cache) != local
    with pytest.raises(BadInputError, match="acme/absent: not found on the Hub"):
        model_folder(load_model_card("acme/absent"), hub.settings.cache_dir)


def test_a_checked_shard_is_not_hashed_again_until_its_blob_changes(hub, checkpoints, monkeypatch):
    import swarm.hub as hub_module

    hashed: list[Path] = []
    real = hub_module.sha256_file
    monkeypatch.setattr(hub_module, "sha256_file", lambda p: hashed.append(p) or real(p))
    resolved = resolve(HubName(REPO), hub.settings)
    shards = sorted(f for f in resolved.files if f.endswith(".safetensors"))[:2]
    folder = fetch(resolved, shards, hub.settings)
    assert len(hashed) == 2  # each checked once, as it arrived
    fetch(resolved, shards, hub.settings)
    assert len(hashed) == 2  # a second start: the memo says they are the blobs checked, unchanged
    blob = (folder / shards[0]).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # the same size, other bytes: a disk's or someone's change since
    blob.write_bytes(bytes(data))
    fetch(resolved, shards, hub.settings)
    assert len(hashed) == 4  # hashed again, found wrong, fetched and checked again; the other untouched
    assert (folder / shards[0]).read_bytes() == (checkpoints[0] / shards[0]).read_bytes()


def _hub_env(monkeypatch, hub, offline: bool = False) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.settings.cache_dir))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_each_party_fetches_only_the_shards_it_reads(hub, checkpoints, monkeypatch):
    """A Hub model's folder starts with no weights; a server's span, a broker's move and a client's three modules
    fetch the shards holding what each reads, the memory plan of every block reads headers alone, and the
    fingerprint is the whole local folder's whichever shards are held; offline, a later start reads what it has."""
    from swarm.families.spec import family_of
    from swarm.families.weights import block_bytes, load_layers
    from swarm.model_files import load_config, model_folder, read_tensors, weights_fingerprint

    _hub_env(monkeypatch, hub)
    original = checkpoints[0]
    folder = model_folder(load_model_card(REPO), hub.settings.cache_dir)
    weights = lambda: {p for p in hub.sent_for(REPO) if p.endswith(".safetensors")}  # noqa: E731
    assert weights() == set()  # config, tokenizer and index only
    family = family_of(load_config(folder))
    assert block_bytes(family, folder, torch.float32) == block_bytes(family, original, torch.float32)
    assert weights() == set() and hub.peeked  # every block planned from the shards' headers alone
    index = _weight_map(folder)
    layers = load_layers(family, folder, range(2, 4), torch.float32, "cpu")  # a server of blocks 2:4
    span = shards_for(index, ["model.layers.2.", "model.layers.3."])
    assert weights() == span != set(index.values())
    reference = load_layers(family, original, range(2, 4), torch.float32, "cpu")
    for mine, theirs in zip(layers, reference, strict=True):
        assert all(
            torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values(), strict=True)
        )
    load_layers(family, folder, range(0, 1), torch.float32, "cpu")  # the broker moved it: what it lacks, only
    moved = span | shards_for(index, ["model.layers.0."])
    assert weights() == moved
    client = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    read_tensors(folder, [n for n in client if n in index])  # a client's three modules
    assert weights() == moved | shards_for(index, [], client) != set(index.values())
    for shard in weights():  # each crossed the network once
        assert hub.sent_for(REPO)[shard] == (original / shard).stat().st_size
    cache = hub.settings.cache_dir / "fingerprints"
    assert weights_fingerprint(folder, "float32", cache) == weights_fingerprint(original, "float32", cache)
    _hub_env(monkeypatch, hub, offline=True)
    again = model_folder(load_model_card(REPO), hub.settings.cache_dir)
    assert again == folder and block_bytes(family, again, torch.float32)  # the headers were kept
    load_layers(family, again, range(2, 4), torch.float32, "cpu")
    lacking = sorted(set(index.values()) - weights())[0]
    block = next(int(n.split(".")[2]) for n, f in index.items() if f == lacking and n.startswith("model.layers."))
    with pytest.raises(BadInputError, match=f"no {lacking} in the local cache"):
        load_layers(family, again, range(block, block + 1), torch.float32, "cpu")


def test_the_span_bytes_script_counts_shards_from_the_index_alone(hub, checkpoints, monkeypatch, capsys):
    """``scripts/hub_span_bytes.py``: what a span and a client download, from the index and the Hub's file list
    (no weights fetched); the README's table of well-known models comes from it where the Hub is reachable."""
    from tests.helpers.scripts import load_script

    _hub_env(monkeypatch, hub)
    script = load_script("hub_span_bytes")
    assert script.main([REPO, "--blocks", "0:2", "3:4"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    index = _weight_map(checkpoints[0])
    size = lambda files: sum((checkpoints[0] / f).stat().st_size for f in files)  # noqa: E731
    span = shards_for(index, ["model.layers.0.", "model.layers.1."])
    assert rows[0][0].strip() == "blocks 0:2" and int(rows[0][1]) == len(span)
    assert float(rows[0][2]) == pytest.approx(size(span) / 1e9, abs=0.006)
    assert rows[-1][0].strip() == "the whole checkpoint" and int(rows[-1][1]) == len(set(index.values()))
    assert not {p for p in hub.sent_for(REPO) if p.endswith(".safetensors")}  # nothing but the index was read


def test_the_span_bytes_script_reads_a_clone_s_lfs_pointers_as_the_hub_s_list(
    hub, checkpoints, tmp_path, monkeypatch, capsys
):
    """``--clone``: a Git clone without LFS files (each weight file a pointer naming its size and sha256) gives the
    rows the Hub's file list gives; a weight file that is not a pointer is refused by name."""
    from tests.helpers.scripts import load_script

    _hub_env(monkeypatch, hub)
    script = load_script("hub_span_bytes")
    assert script.main([REPO, "--blocks", "0:2", "3:4"]) == 0
    from_hub = capsys.readouterr().out.splitlines()[2:]
    clone, original = tmp_path / "clone", checkpoints[0]
    clone.mkdir()
    for path in original.iterdir():
        if path.suffix == ".safetensors":
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            pointer = f"{script.LFS_POINTER}\noid sha256:{digest}\nsize {path.stat().st_size}\n"
            (clone / path.name).write_text(pointer)
        elif path.suffix == ".json":
            shutil.copy(path, clone / path.name)
    assert script.main(["--clone", str(clone), "--blocks", "0:2", "3:4"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == from_hub
    shard = sorted(p for p in clone.iterdir() if p.suffix == ".safetensors")[0]
    shutil.copy(original / shard.name, shard)  # a clone that fetched its LFS files
    with pytest.raises(SystemExit, match=f"{shard.name} is not a Git LFS pointer"):
        script.main(["--clone", str(clone), "--blocks", "0:2"])


def test_a_drafter_named_by_the_hub_is_fetched_whole_and_runs_its_weights(hub, checkpoints, monkeypatch):
    """``generate(..., speculative="ORG/NAME@REV")``, ``swarm.api --draft ORG/NAME``: the draft model runs whole on
    the client, so every shard of that revision is fetched (and checked), and its logits are that checkpoint's."""
    from transformers import AutoModelForCausalLM

    from swarm.client.speculative import drafting

    _hub_env(monkeypatch, hub)
    compared = []  # the tiny checkpoints have no tokenizer to compare: the check is called, not run
    monkeypatch.setattr(drafting, "same_tokenizer", lambda folder, served: compared.append((folder, served)))
    drafter = drafting.drafter_factory(f"{REPO}@v2", checkpoints[0], hub.settings.cache_dir)()
    assert compared and compared[0][1] == checkpoints[0]
    assert {p for p in hub.sent_for(REPO) if p.endswith(".safetensors")} == set(_weight_map(checkpoints[1]).values())
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    ref = AutoModelForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(drafter.model(ids).logits, ref(ids).logits, atol=1e-6)


def test_a_run_continuing_from_a_hub_model_starts_from_its_weights(hub, checkpoints, monkeypatch, tmp_path):
    """A run file's ``from = "ORG/NAME"``: the whole model one process trains (the swarm's reference) fetches every
    shard and starts from that checkpoint's weights, not from seeds."""
    from swarm.training.init import initial_model
    from swarm.training.run import load_run

    _hub_env(monkeypatch, hub)
    text = (Path(__file__).parents[2] / "configs/runs/tiny-llama.toml").read_text()
    head, _, rest = text.partition("[model]")
    rest = rest[rest.index("\n[data]") :]  # the seeded config's fields out, the Hub name in
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'{head}[model]\nfrom = "{REPO}"\n{rest}')
    model = initial_model(load_run(run_file, tmp_path / "cache"))
    assert {p for p in hub.sent_for(REPO) if p.endswith(".safetensors")} == set(_weight_map(checkpoints[0]).values())
    saved = {}
    for file in set(_weight_map(checkpoints[0]).values()):
        saved.update(load_file(str(checkpoints[0] / file)))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
