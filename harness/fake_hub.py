"""A local HTTP server speaking the part of the Hugging Face Hub's API that ``huggingface_hub`` uses to resolve a
model's revision and download its files, serving model folders of this machine: what tests point ``HF_ENDPOINT`` at
(no hub is reachable here). It counts the bytes it sends per file, and can misbehave on purpose: corrupt a file's
bytes, or cut a download part-way, a given number of times.

What it answers (as the Hub does):

- ``GET /api/models/ORG/NAME[/revision/REV]``: the repository at a revision: its commit (``sha``) and files
  (``siblings``: name, size, and for weights, their LFS sha256 and size);
- ``HEAD``/``GET /ORG/NAME/resolve/REV/PATH``: the file, with ``X-Repo-Commit``, an ``ETag`` (the sha256 of a weights
  file, as for LFS files; a git-blob sha1 of others), ``Content-Length`` and byte ranges (``Range: bytes=N-`` or
  ``bytes=N-M``: 206; a closed range, a header's read, is counted as peeked, not sent);
- errors with the Hub's ``X-Error-Code``: ``RepoNotFound`` (401), ``RevisionNotFound``, ``EntryNotFound`` (404),
  ``GatedRepo`` (401 without the token of a gated repository, 403 with another)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from swarm.dashboard.server import ThreadedServer
from swarm.hub import sha256_file

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".onnx")
CHUNK = 1 << 16


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Revision:
    """One revision of a repository: the folder it serves and its commit."""

    folder: Path
    commit: str
    files: dict[str, tuple[int, str, bool]] = field(default_factory=dict)  # path -> (size, etag, is LFS)

    @classmethod
    def of(cls, folder: Path, name: str) -> Revision:
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            lfs = rel.endswith(LFS_SUFFIXES)
            etag = sha256_file(path) if lfs else git_blob_sha1(path.read_bytes())
            files[rel] = (path.stat().st_size, etag, lfs)
        commit = hashlib.sha1(repr((name, sorted(files.items()))).encode()).hexdigest()
        return cls(folder, commit, files)


@dataclass
class Fault:
    kind: str  # "corrupt": every byte of the file flipped; "cut": the connection closed after ``after`` bytes
    times: int
    after: int = 0


class FakeHub:
    """``with FakeHub() as hub: hub.add("org/name", folder)``; ``hub.url`` is what ``HF_ENDPOINT`` takes."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Revision]] = {}  # repo -> revision name or commit -> revision
        self.gated: dict[str, str] = {}  # repo -> the token that may read it
        self.sent: Counter[tuple[str, str]] = Counter()  # (repo, path) -> bytes of file content sent
        self.peeked: Counter[tuple[str, str]] = Counter()  # ...of it in reads of a closed range (a header's)
        self.faults: dict[tuple[str, str], Fault] = {}
        self._server: ThreadedServer | None = None

    # -- set-up --------------------------------------------------------------------------------------------------------

    def add(self, repo: str, folder: Path, revision: str = "main", token: str | None = None) -> str:
        """Serve ``folder`` as ``repo`` at ``revision`` (``token``: the repository is gated, readable with it only);
        the revision's commit."""
        rev = Revision.of(Path(folder), f"{repo}@{revision}")
        revisions = self.repos.setdefault(repo, {})
        revisions[revision] = revisions[rev.commit] = rev
        if token is not None:
            self.gated[repo] = token
        return rev.commit

    def corrupt(self, repo: str, path: str, times: int = 1) -> None:
        self.faults[(repo, path)] = Fault("corrupt", times)

    def cut(self, repo: str, path: str, after: int, times: int = 1) -> None:
        self.faults[(repo, path)] = Fault("cut", times, after)

    def sent_for(self, repo: str) -> dict[str, int]:
        return {path: n for (r, path), n in self.sent.items() if r == repo and n}

    # -- the server ----------------------------------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        app = Starlette(
            routes=[
                Route("/api/models/{org}/{name}", self._info, methods=["GET"]),
                Route("/api/models/{org}/{name}/revision/{revision:path}", self._info, methods=["GET"]),
                Route("/{org}/{name}/resolve/{revision}/{path:path}", self._file, methods=["GET", "HEAD"]),
            ]
        )
        self._server = ThreadedServer(app, "127.0.0.1", 0, name="fake-hub")
        self._server.wait_started()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    # -- answers -------------------------------------------------------------------------------------------------------

    def _revision(self, request: Request) -> tuple[str, Revision] | Response:
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        revision = request.path_params.get("revision", "main")
        if repo not in self.repos:
            return _error(401, "RepoNotFound", f"Repository Not Found for url: {request.url}.")
        token = self.gated.get(repo)
        if token is not None:
            given = request.headers.get("authorization", "")
            if given != f"Bearer {token}":
                status = 403 if given else 401
                return _error(status, "GatedRepo", f"Access to model {repo} is restricted. You must have access to it.")
        rev = self.repos[repo].get(revision)
        if rev is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, rev

    async def _info(self, request: Request) -> Response:
        found = self._revision(request)
        if isinstance(found, Response):
            return found
        repo, rev = found
        siblings = []
        for path, (size, etag, lfs) in rev.files.items():
            entry: dict[str, object] = {"rfilename": path, "size": size}
            if lfs:
                entry["lfs"] = {"sha256": etag, "size": size, "pointerSize": 134}
            else:
                entry["blobId"] = etag
            siblings.append(entry)
        gated = "manual" if repo in self.gated else False
        return JSONResponse(
            {"id": repo, "modelId": repo, "sha": rev.commit, "private": False, "gated": gated, "siblings": siblings}
        )

    async def _file(self, request: Request) -> Response:
        found = self._revision(request)
        if isinstance(found, Response):
            return found
        repo, rev = found
        path = request.path_params["path"]
        if path not in rev.files:
            return _error(404, "EntryNotFound", f"{path} does not exist on revision {rev.commit}")
        size, etag, lfs = rev.files[path]
        headers = {
            "X-Repo-Commit": rev.commit,
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
        }
        if lfs:  # what the Hub sends for LFS files (before its redirect to the CDN)
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(size)
        start, last = _range(request.headers.get("range"), size)
        if start is not None and start >= size:
            return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
        first = start or 0
        status = 206 if start is not None else 200
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        headers["Content-Length"] = str(last + 1 - first)
        if request.method == "HEAD":
            return Response(status_code=200, headers={**headers, "Content-Length": str(size)})
        if status == 206 and _closed(request.headers.get("range")):  # a header's read (``bytes=0-100000``)
            self.peeked[(repo, path)] += last + 1 - first
            return Response(content=_read(rev.folder / path, first, last + 1), status_code=206, headers=headers)
        fault = self.faults.get((repo, path))
        if fault is not None and fault.times > 0:
            fault.times -= 1
        else:
            fault = None
        return StreamingResponse(
            self._body(repo, path, rev.folder / path, first, last + 1, fault), status_code=status, headers=headers
        )

    async def _body(
        self, repo: str, path: str, file: Path, start: int, stop: int, fault: Fault | None
    ) -> AsyncIterator[bytes]:
        sent = 0
        with file.open("rb") as f:
            f.seek(start)
            while block := f.read(min(CHUNK, stop - start - sent)):
                if fault is not None and fault.kind == "cut" and start + sent + len(block) > fault.after:
                    block = block[: max(fault.after - start - sent, 0)]
                    if block:
                        self.sent[(repo, path)] += len(block)
                        yield block
                    raise ConnectionAbortedError(f"fake hub: {path} cut after {fault.after} bytes")
                if fault is not None and fault.kind == "corrupt":
                    block = bytes(b ^ 0xFF for b in block)
                sent += len(block)
                self.sent[(repo, path)] += len(block)
                yield block


def _range(header: str | None, size: int) -> tuple[int | None, int]:
    """(first byte, last byte) of ``Range: bytes=N-`` or ``bytes=N-M`` (first None: the whole file)."""
    if not header or not header.startswith("bytes="):
        return None, size - 1
    first, _, last = header[len("bytes=") :].partition("-")
    if not first.strip().isdigit():
        return None, size - 1
    end = int(last) if last.strip().isdigit() else size - 1
    return int(first), min(end, size - 1)


def _closed(header: str | None) -> bool:
    """A range with an end: a part of the file read (a download resumes with an open one, ``bytes=N-``)."""
    return header is not None and header.rstrip()[-1:].isdigit()


def _read(file: Path, start: int, stop: int) -> bytes:
    with file.open("rb") as f:
        f.seek(start)
        return f.read(stop - start)


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse(
        {"error": message}, status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message}
    )
