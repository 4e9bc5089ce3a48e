"""Models by their Hugging Face Hub names (``ORG/NAME[@REVISION]``), downloading only the files a party needs.

A name resolves to a commit (``resolve``): the revision a peer serves is that commit, whatever branch or tag was
typed, and what the swarm agrees on. ``fetch`` brings files of that commit into ``huggingface_hub``'s shared cache
(where transformers finds what it downloaded before, and ``HF_HUB_CACHE`` moves it), so the snapshot folder it
returns holds those files and no others: a server fetches its blocks' shards (``shards_for`` over the checkpoint's
index), a client the shards of its embeddings, norm and head. Each file is checked against what the Hub lists for it
before use (an LFS file's sha256, every file's size); a file that fails is removed and fetched once more, then
refused with the reason (a blob checked once is not hashed again while unchanged: ``Verified``). Downloads resume
where an interrupted one stopped (``huggingface_hub``'s own ``.incomplete`` files), the disk's free space is checked
before anything is fetched (the refusal names the bytes), ``HF_TOKEN`` or ``--token`` opens gated models (a refusal
names the model), and ``HF_HUB_OFFLINE`` reads only the cache."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import BadInputError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]{1,128}))?$")
ALWAYS = (  # what every party reads besides weights: config, tokenizer, and the index that maps tensors to shards
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "model.safetensors.index.json",
)
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HubName:
    repo: str
    revision: str = "main"

    @classmethod
    def parse(cls, text: str) -> HubName | None:
        """``ORG/NAME`` or ``ORG/NAME@REVISION``; None for anything else (a folder on disk, a model card's name)."""
        m = _NAME.match(text.strip())
        if m is None or Path(text).expanduser().exists():
            return None
        return cls(m["repo"], m["revision"] or "main")

    def __str__(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"


@dataclass(frozen=True)
class HubFile:
    size: int
    sha256: str | None  # an LFS file's (weights); None for small files kept in git


@dataclass(frozen=True)
class Resolved:
    """A name at one commit, and the files the Hub lists there."""

    name: HubName
    commit: str
    files: Mapping[str, HubFile]


@dataclass(frozen=True)
class HubSettings:
    """Where and how to reach the Hub: ``endpoint`` (``HF_ENDPOINT``), the shared cache (``HF_HUB_CACHE``, else
    ``HF_HOME``/hub, else ~/.cache/huggingface/hub), a token (``HF_TOKEN``) and offline mode (``HF_HUB_OFFLINE``),
    read when asked (``from_env``), not when a library was imported."""

    endpoint: str = "https://huggingface.co"
    cache_dir: Path = Path("~/.cache/huggingface/hub").expanduser()
    token: str | None = None
    offline: bool = False

    @classmethod
    def from_env(cls, token: str | None = None) -> HubSettings:
        env = os.environ
        home = Path(env.get("HF_HOME", "~/.cache/huggingface")).expanduser()
        cache = Path(env["HF_HUB_CACHE"]).expanduser() if env.get("HF_HUB_CACHE") else home / "hub"
        offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        endpoint = env.get("HF_ENDPOINT", cls.endpoint).rstrip("/")
        return cls(endpoint, cache, token or env.get("HF_TOKEN") or None, offline)

    def repo_dir(self, name: HubName) -> Path:
        return self.cache_dir / f"models--{name.repo.replace('/', '--')}"


def refusal(name: HubName, e: Exception) -> BadInputError:
    """A clear error for the caller, naming the model, out of ``huggingface_hub``'s."""
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return BadInputError(
            f"model {name} is gated: accept its terms on the Hub, then give a token that may read it "
            f"(HF_TOKEN, or --token); the Hub said: {str(e).splitlines()[-1][:200]}"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return BadInputError(f"model {name}: no revision {name.revision!r} on the Hub")
    if isinstance(e, errors.RepositoryNotFoundError):
        return BadInputError(f"model {name}: not found on the Hub (or private: its token goes in HF_TOKEN or --token)")
    if isinstance(e, errors.LocalEntryNotFoundError) or isinstance(e, errors.OfflineModeIsEnabled):
        return BadInputError(f"model {name}: not in the local cache, and the Hub is not reachable (or HF_HUB_OFFLINE)")
    return BadInputError(f"model {name}: the Hub answered {type(e).__name__}: {str(e)[:300]}")


def resolve(name: HubName, hub: HubSettings) -> Resolved:
    """The commit ``name`` points at now and its files (offline: the commit the cache last saw for it)."""
    from huggingface_hub import HfApi, errors

    if hub.offline:
        return _resolve_cached(name, hub)
    try:
        api = HfApi(endpoint=hub.endpoint, token=hub.token or False)
        info = api.model_info(name.repo, revision=name.revision, files_metadata=True)
    except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, OSError) as e:
        raise refusal(name, e) from None
    if info.sha is None:
        raise BadInputError(f"model {name}: the Hub named no commit for it")
    files = {
        s.rfilename: HubFile(int(s.lfs.size if s.lfs else (s.size or 0)), s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or ()
    }
    if name.revision != info.sha:  # as huggingface_hub records it: offline, the name finds this commit again
        write_atomic(hub.repo_dir(name) / "refs" / name.revision, info.sha)
    resolved = Resolved(name, info.sha, files)
    listing = {path: [f.size, f.sha256] for path, f in files.items()}
    write_atomic(listing_path(hub.repo_dir(name), info.sha), json.dumps({"repo": name.repo, "files": listing}))
    return resolved


def listing_path(repo_dir: Path, commit: str) -> Path:
    """Where the files the Hub listed at ``commit`` are kept (``resolve``): a snapshot folder holding only some shards
    is still known whole by it (``swarm.hub_snapshot``: shards fetched when read, the fingerprint of every weight
    file's sha256), offline too. Beside the folders ``huggingface_hub`` reads, which its cache scan ignores."""
    return repo_dir / "swarm-files" / f"{commit}.json"


def read_listing(repo_dir: Path, commit: str) -> tuple[str, dict[str, HubFile]] | None:
    """(repository, files) as ``resolve`` kept them for ``commit``; None if it kept none (or it is garbled)."""
    try:
        data = json.loads(listing_path(repo_dir, commit).read_text())
        files = {str(k): HubFile(int(v[0]), None if v[1] is None else str(v[1])) for k, v in data["files"].items()}
        return str(data["repo"]), files
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)  # whole or not at all: a reader never sees half of it


def _resolve_cached(name: HubName, hub: HubSettings) -> Resolved:
    repo_dir = hub.repo_dir(name)
    ref = repo_dir / "refs" / name.revision
    commit = ref.read_text().strip() if ref.is_file() else name.revision
    snapshot = repo_dir / "snapshots" / commit
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not snapshot.is_dir():
        raise BadInputError(f"model {name}: not in the local cache, and HF_HUB_OFFLINE is set")
    listed = read_listing(repo_dir, commit)
    if listed is not None:  # what the Hub listed when it was online: every file, with its sha256
        return Resolved(name, commit, listed[1])
    files = {p.relative_to(snapshot).as_posix(): HubFile(p.stat().st_size, None) for p in snapshot.rglob("*")}
    return Resolved(name, commit, {k: v for k, v in files.items() if (snapshot / k).is_file()})


def shards_for(index: Mapping[str, str], prefixes: Iterable[str], exact: Iterable[str] = ()) -> set[str]:
    """The shard files (``index``: tensor name -> file, a checkpoint's ``weight_map``) holding any tensor whose name
    starts with one of ``prefixes`` or is one of ``exact``."""
    starts, names = tuple(prefixes), set(exact)
    return {file for tensor, file in index.items() if tensor in names or (starts and tensor.startswith(starts))}


def fetch(resolved: Resolved, paths: Iterable[str], hub: HubSettings, optional: Iterable[str] = ()) -> Path:
    """Files ``paths`` of the resolved commit, and those of ``optional`` it has, in the shared cache, each checked;
    the snapshot folder that holds them."""
    from huggingface_hub import errors, hf_hub_download

    required = set(paths)
    absent = sorted(required - set(resolved.files))
    if absent:
        place = "in the local cache (HF_HUB_OFFLINE)" if hub.offline else f"at commit {resolved.commit}"
        raise BadInputError(f"model {resolved.name} has no {', '.join(absent[:5])} {place}")
    wanted = sorted(required | {p for p in optional if p in resolved.files})
    snapshot = hub.repo_dir(resolved.name) / "snapshots" / resolved.commit
    missing = [p for p in wanted if not _intact(snapshot / p, resolved.files[p], check_hash=False)]
    if hub.offline and set(missing) & required:
        lacking = sorted(set(missing) & required)
        raise BadInputError(
            f"model {resolved.name} has no {', '.join(lacking[:5])} in the local cache (HF_HUB_OFFLINE)"
        )
    need = sum(resolved.files[p].size for p in missing)
    if need:
        where = hub.cache_dir
        where.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(where).free
        if free < need:
            raise BadInputError(
                f"model {resolved.name}: {len(missing)} files need {need / 1e9:.2f} GB in {where}, "
                f"which has {free / 1e9:.2f} GB free"
            )
        log.info("downloading %d files of %s (%.1f MB)", len(missing), resolved.name, need / 1e6)
    memo = Verified(hub.repo_dir(resolved.name))
    done: list[str] = []
    for path in wanted:
        for attempt in (1, 2):
            try:
                local = Path(
                    hf_hub_download(
                        resolved.name.repo,
                        path,
                        revision=resolved.commit,
                        endpoint=hub.endpoint,
                        cache_dir=hub.cache_dir,
                        token=hub.token or False,
                        local_files_only=hub.offline,
                    )
                )
            except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError, OSError) as e:
                raise refusal(resolved.name, e) from None
            problem = None if memo.holds(local, resolved.files[path]) else _problem(local, resolved.files[path])
            if problem is None:
                memo.add(local, resolved.files[path])
                break
            _forget(local)  # the blob and its link: the next download starts from nothing
            if attempt == 2:
                raise BadInputError(f"model {resolved.name}: {path} {problem}, twice: refused")
            log.warning("model %s: %s %s; fetching it again", resolved.name, path, problem)
        if path in missing:
            done.append(path)
            _progress(resolved, done, missing, need)
    return snapshot


def _progress(resolved: Resolved, done: list[str], missing: list[str], need: int) -> None:
    """One line per file fetched: in a JSON log its ``progress`` field (files and bytes done of the fetch's) is what
    a collector follows, where a terminal shows ``huggingface_hub``'s bars."""
    got = sum(resolved.files[p].size for p in done)
    log.info(
        "fetched %s of %s: %d of %d files, %.1f of %.1f MB",
        done[-1],
        resolved.name,
        len(done),
        len(missing),
        got / 1e6,
        need / 1e6,
        extra={
            "kind": "download",
            "progress": {"file": done[-1], "files": [len(done), len(missing)], "bytes": [got, need]},
        },
    )


class Verified:
    """The weight files of one cached repository whose sha256 was checked, by blob, with the size and modification
    time the blob had then: a start that loads the same shards again skips hashing them (minutes for a large model),
    and a blob changed since is hashed again. Kept in the repository's cache folder beside the folders
    ``huggingface_hub`` reads (``swarm-verified.json``); a memo lost or garbled only costs a hash."""

    FILE = "swarm-verified.json"

    def __init__(self, repo_dir: Path) -> None:
        self.path = repo_dir / self.FILE

    def _read(self) -> dict[str, list[int]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _stamp(blob: Path) -> list[int]:
        st = blob.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def holds(self, local: Path, expected: HubFile) -> bool:
        """Whether ``local`` (a link to its blob) was checked against ``expected`` and has not changed since."""
        if expected.sha256 is None:
            return False  # a small file: checked by size, at no cost
        blob = local.resolve()
        return blob.name == expected.sha256 and self._read().get(blob.name) == self._stamp(blob)

    def add(self, local: Path, expected: HubFile) -> None:
        if expected.sha256 is None:
            return
        blob = local.resolve()
        memo = self._read()
        memo[blob.name] = self._stamp(blob)
        tmp = self.path.with_name(f".{self.FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(memo))
            tmp.replace(self.path)  # whole or not at all: a reader never sees half of it
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache: the next start hashes again


def _problem(local: Path, expected: HubFile) -> str | None:
    """Why a downloaded file is not the one the Hub lists (None: it is)."""
    size = local.stat().st_size
    if size != expected.size and expected.size:
        return f"has {size} bytes where the Hub lists {expected.size}"
    if expected.sha256 is not None and sha256_file(local) != expected.sha256:
        return "does not match the sha256 the Hub lists"
    return None


def _intact(local: Path, expected: HubFile, check_hash: bool = True) -> bool:
    if not local.is_file():
        return False
    if not check_hash:
        return local.stat().st_size == expected.size or not expected.size
    return _problem(local, expected) is None


def sha256_file(path: Path) -> str:
    """A file's sha256, as the Hub lists an LFS file's (hex)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _forget(local: Path) -> None:
    blob = local.resolve()
    local.unlink(missing_ok=True)
    if blob != local:
        blob.unlink(missing_ok=True)


def hub_model(text: str, hub: HubSettings) -> Path:
    """A Hub model's snapshot folder with its config, tokenizer and index fetched and checked, and no weights yet: each
    party reads it as any model folder, and the shards holding the tensors it reads are fetched then
    (``swarm.hub_snapshot``): a server its span's, a client its embeddings', norm's and head's."""
    name = HubName.parse(text)
    if name is None:
        raise BadInputError(f"{text!r} is not a Hub name (ORG/NAME[@REVISION])")
    resolved = resolve(name, hub)
    if INDEX not in resolved.files and "model.safetensors" not in resolved.files:
        raise BadInputError(f"model {name} has no safetensors weights (model.safetensors or {INDEX}) on the Hub")
    return fetch(resolved, [], hub, optional=ALWAYS)


def add_token_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help="a Hugging Face token, for gated or private models named by Hub name (default: HF_TOKEN, which other "
        "users of the machine cannot read, as they can a command line)",
    )


def use_token(token: str | None) -> None:
    """``--token``: this process's Hub token, as ``HF_TOKEN`` (read wherever a Hub name is resolved, by this process
    and the ones it starts)."""
    if token:
        os.environ["HF_TOKEN"] = token
