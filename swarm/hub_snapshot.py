"""A Hub model's snapshot folder read as any model folder, though it holds only the shards fetched so far.

``swarm.hub.hub_model`` leaves config, tokenizer and index in the snapshot and kept the files the Hub listed at its
commit (``swarm.hub.listing_path``). From there:

- ``ensure``: before a shard is read it is fetched and checked (``swarm.hub.fetch``), so each party downloads what
  it reads: a server the shards of its span (and of a new span when the broker moves it), a client those of its
  embeddings, norm and head, a judge those of the span it judges;
- ``shapes``: a shard's tensor names and shapes, from the file when it is here, else from its safetensors header
  alone (``huggingface_hub``'s ranged read of the first bytes): what a server plans its memory with, for every block,
  without fetching them; kept beside the listing, so offline starts read them too;
- ``file_digests``: each weight file's sha256 as the Hub listed it (the fingerprint: the same as a whole local
  folder of the same files computes by hashing them, whichever shards are held).

A folder that is not a Hub snapshot with a listing is left alone (``snapshot_of`` is None)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import BadInputError
from swarm.hub import HubName, HubSettings, Resolved, fetch, read_listing, refusal, write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    resolved: Resolved
    hub: HubSettings
    folder: Path

    def missing(self, files: Iterable[str]) -> list[str]:
        return sorted({f for f in files if not (self.folder / f).is_file()})


def snapshot_of(folder: Path) -> Snapshot | None:
    """The Hub commit ``folder`` is the snapshot of (``<cache>/models--ORG--NAME/snapshots/<commit>``), if
    ``swarm.hub.resolve`` kept its listing."""
    folder = Path(folder)
    repo_dir = folder.parent.parent
    if folder.parent.name != "snapshots" or not repo_dir.name.startswith("models--"):
        return None
    listed = read_listing(repo_dir, folder.name)
    if listed is None:
        return None
    repo, files = listed
    hub = HubSettings.from_env()
    hub = HubSettings(hub.endpoint, repo_dir.parent, hub.token, hub.offline)  # the cache this folder is in
    return Snapshot(Resolved(HubName(repo, folder.name), folder.name, files), hub, folder)


def ensure(folder: Path, files: Iterable[str]) -> None:
    """Fetch (and check) those of ``files`` a Hub snapshot lacks; nothing for any other folder."""
    snap = snapshot_of(folder)
    if snap is None:
        return
    missing = snap.missing(files)
    if missing:
        log.info("fetching %d shards of %s: %s", len(missing), snap.resolved.name.repo, ", ".join(missing[:8]))
        fetch(snap.resolved, missing, snap.hub)


def shapes(folder: Path, file: str) -> dict[str, list[int]] | None:
    """Tensor name -> shape of shard ``file`` of a Hub snapshot that lacks it, from its header; None when the file
    is here (read it) or the folder is no Hub snapshot."""
    snap = snapshot_of(folder)
    if snap is None or (snap.folder / file).is_file():
        return None
    memo_path = snap.folder.parent.parent / "swarm-files" / f"{snap.resolved.commit}.headers.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if file not in memo:
        memo[file] = _header_shapes(snap, file)
        write_atomic(memo_path, json.dumps(memo))
    return {str(k): [int(d) for d in v] for k, v in memo[file].items()}


def _header_shapes(snap: Snapshot, file: str) -> dict[str, list[int]]:
    from huggingface_hub import HfApi, errors

    name = snap.resolved.name
    if snap.hub.offline:
        raise BadInputError(f"model {name.repo}: {file} is not in the local cache, and HF_HUB_OFFLINE is set")
    try:
        api = HfApi(endpoint=snap.hub.endpoint, token=snap.hub.token or False)
        meta = api.parse_safetensors_file_metadata(name.repo, file, revision=snap.resolved.commit)
    except (errors.HfHubHTTPError, errors.SafetensorsParsingError, OSError) as e:
        raise refusal(name, e) from None
    return {n: list(t.shape) for n, t in meta.tensors.items()}


def file_digests(folder: Path) -> dict[str, str] | None:
    """Each top-level weight file (``*.safetensors``) of a Hub snapshot -> its sha256 as the Hub listed it; None
    for another folder, or where the Hub listed a weight file without one."""
    snap = snapshot_of(folder)
    if snap is None:
        return None
    files = {p: f for p, f in snap.resolved.files.items() if p.endswith(".safetensors") and "/" not in p}
    if not files or any(f.sha256 is None for f in files.values()):
        return None
    return {p: str(f.sha256) for p, f in files.items()}
