"""What ``python -m swarm.api`` accepts: its flags, as frozen config objects (``swarm.cli`` turns their fields into
flags), built by the entry point and handed to the service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarm.api.limits import Limits
from swarm.cli import option
from swarm.dashboard.guard import ConnectionLimits
from swarm.errors import BadInputError


def _key_file(text: str) -> Path:
    return Path(text)


@dataclass(frozen=True)
class ApiLimits:
    """What one caller, and all together, may ask of the API (``swarm.api.limits``)."""

    max_concurrent: int = option(Limits.max_concurrent, help="generations running at once, all callers together")
    max_client_concurrent: int = option(Limits.max_client_concurrent, help="...and of one caller (key or address)")
    max_tokens_limit: int = option(Limits.max_tokens, help="largest max_tokens a request may ask for")
    max_body_kb: int = option(Limits.max_body_bytes // 1024, help="largest request body, in KiB")
    request_timeout: float = option(Limits.request_timeout, help="seconds one generation may run")

    def limits(self) -> Limits:
        out = Limits(
            self.max_concurrent,
            self.max_client_concurrent,
            self.max_tokens_limit,
            self.max_body_kb * 1024,
            self.request_timeout,
        )
        try:
            out.check()
        except ValueError as e:
            raise BadInputError(str(e)) from None
        return out


_C = ConnectionLimits


@dataclass(frozen=True)
class ApiConnections:
    """How long a connection may take, and how many may be open (``swarm.dashboard.guard``): a caller becomes a key
    holder by showing a valid key; everyone else shares a small pool."""

    header_timeout: float = option(
        _C.header_timeout, help="seconds for a request's head to arrive (after connecting or a response); then cut"
    )
    body_timeout: float = option(30.0, help="seconds for a request's body to arrive; 400 after")
    write_timeout: float = option(
        _C.write_timeout, help="seconds a client may leave a full buffer of response unread; then cut"
    )
    keep_alive_timeout: float = option(_C.keep_alive_timeout, help="seconds an idle kept-alive connection stays open")
    max_connections: int = option(_C.max_connections, help="open connections, all together")
    max_pending_connections: int = option(
        _C.max_pending, help="...of which have shown no API key yet (a new one beyond cuts the oldest)"
    )
    max_requests: int | None = option(
        None, help="key holders' requests at once, 503 beyond (default: 4 per --max-concurrent + 32)"
    )
    max_public_requests: int = option(
        _C.max_public_requests, help="requests without a valid API key at once (health, metrics, login); 503 beyond"
    )

    def limits(self, max_concurrent: int) -> ConnectionLimits:
        requests = self.max_requests if self.max_requests is not None else max_concurrent * 4 + 32
        out = ConnectionLimits(
            self.header_timeout,
            self.write_timeout,
            self.keep_alive_timeout,
            self.max_connections,
            self.max_pending_connections,
            requests,
            self.max_public_requests,
        )
        try:
            out.check()
            if self.body_timeout <= 0:
                raise ValueError("--body-timeout must be positive")
        except ValueError as e:
            raise BadInputError(str(e)) from None
        return out


@dataclass(frozen=True)
class ApiConfig:
    """Everything ``python -m swarm.api`` accepts."""

    models: tuple[str, ...] = option(
        ("smollm2-135m",), name="--model", metavar="NAME", help="model card name(s) or Hugging Face folder(s) to serve"
    )
    initial_peers: tuple[str, ...] = option((), help="peers of the running swarm", metavar="MADDR")
    host: str = option("127.0.0.1", help="address to listen on (loopback only by default)")
    port: int = option(8000, help="HTTP port (0 = any free port)")
    api_keys: tuple[str, ...] = option(
        (), name="--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (one of these keys)"
    )
    api_key_file: Path | None = option(
        None, parse=_key_file, metavar="FILE", help="...or keys read from this file, one per line"
    )
    swarm_key: Path | None = option(None, metavar="FILE", help="a private swarm's key file")
    threads: int = option(1, help="torch threads for the local embeddings and heads")
    max_context: int | None = option(None, help="cap on prompt + completion tokens (default: the model's context)")
    keep_sessions: int = option(
        2,
        metavar="N",
        help="sessions of each caller's last answers kept open on the servers, so a conversation's next turn sends "
        "and computes only what is new (0: none; docs/api.md)",
    )
    keep_idle: float = option(30.0, metavar="S", help="...each closed after this long unused")
    prefix_cache: bool = option(
        True,
        help="do not ask servers to keep finished answers' KV for the same key's later prompts that start alike",
    )
    share_prefixes: bool = option(
        False,
        help="let every key share kept prefixes (a public system prompt) with every caller that shares, on "
        "servers that allow it (--share-prefixes there too; docs/api.md)",
    )
    codec: str = option("auto", help="activations' codec: 'auto' (per link) or one to force, e.g. 'none'")
    local_blocks: int = option(
        0, metavar="N", help="run the first N blocks here: no server sees the embeddings (docs/serving.md)"
    )
    trusted_peers: tuple[str, ...] = option(
        (), metavar="PEER_ID", help="route only through these peers (blocks none of them serves are missing)"
    )
    allow_quantized: tuple[str, ...] = option(
        (),
        metavar="FORMAT",
        help="also route through servers holding quantized blocks in these formats (int8, nf4; default: only the "
        "exact weights); the route of each answer names every hop's format",
    )
    draft: str | None = option(
        None,
        metavar="SPEC",
        help="speculative decoding: 'ngram' (prompt lookup), 'first:N' (the model's first N blocks) or a draft "
        "model's name or folder (docs/speculative.md)",
    )
    draft_max: int = option(8, metavar="K", help="...at most K drafted tokens a trip (chosen from measurements)")
    dashboard: bool = option(True, help="do not serve the web dashboard and chat page")
    limits: ApiLimits = field(default_factory=ApiLimits)
    connections: ApiConnections = field(default_factory=ApiConnections)

    def keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            keys += [k.strip() for k in self.api_key_file.read_text().splitlines() if k.strip()]
        if any(len(k) < 8 for k in keys):
            raise BadInputError("an API key needs at least 8 characters")
        return tuple(keys)
