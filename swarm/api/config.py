"""What ``python -m swarm.api`` accepts: its flags, as frozen config objects (``swarm.cli`` turns their fields into
flags), built by the entry point and handed to the service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarm.api.limits import Limits
from swarm.cli import option
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
    codec: str = option("auto", help="activations' codec: 'auto' (per link) or one to force, e.g. 'none'")
    dashboard: bool = option(True, help="do not serve the web dashboard and chat page")
    limits: ApiLimits = field(default_factory=ApiLimits)

    def keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            keys += [k.strip() for k in self.api_key_file.read_text().splitlines() if k.strip()]
        if any(len(k) < 8 for k in keys):
            raise BadInputError("an API key needs at least 8 characters")
        return tuple(keys)
