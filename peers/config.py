"""A volunteer peer's configuration, by concern; every field is also the flag of ``python -m swarm.serve`` that sets
it (``swarm.cli``), so each default is written once, here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarm.cli import option
from swarm.config import Timing, default_cache_dir
from swarm.errors import BadInputError
from swarm.ids import Span, parse_span

MIB = 1024 * 1024


def _port_or_off(text: str) -> int | None:
    if text == "off":
        return None
    try:
        port = int(text)
    except ValueError:
        raise BadInputError(f"a port flag takes a port number or 'off', got {text!r}") from None
    if not 0 <= port < 65536:
        raise BadInputError(f"a port lies in 0..65535, got {port}")
    return port


def _auto_or_float(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise BadInputError(f"--throughput takes 'auto' or a number, got {text!r}") from None


def _runtime(text: str) -> str:
    if text not in ("torch", "onnx"):  # peers.blocks.runtime.RUNTIMES (not imported here: that pulls in torch)
        raise BadInputError(f"--runtime takes 'torch' or 'onnx', got {text!r}")
    return text


def _mib(text: str) -> int:
    return int(float(text) * MIB)


@dataclass(frozen=True)
class NetworkConfig:
    """Where the peer listens, whom it joins, how others reach it."""

    initial_peers: tuple[str, ...] = option((), help="join the swarm through these running peers", metavar="MADDR")
    new_swarm: bool = option(False, help="start a new swarm")
    host: str = option("127.0.0.1", help="address to listen on (loopback only by default)")
    port: int = option(0, help="libp2p TCP port (0 = any free port)")
    announce_maddrs: tuple[str, ...] = option(
        (), name="--announce-maddr", help="the address(es) others should dial (public IP, port mapping)"
    )
    identity: Path | None = option(None, help="identity file: stable peer id and record key; created if missing")
    swarm_key: Path | None = option(
        None,
        metavar="FILE",
        help="a private swarm's key file: only its holders join and read the swarm "
        "(with --new-swarm, created if missing; give the file to every member)",
    )
    direct_port: int | None = option(
        0, parse=_port_or_off, help="direct (TLS) data plane port (0 = any free port, 'off' = libp2p only)"
    )
    network_mbps: float | None = option(
        None, help="this peer's link bandwidth in Mbit/s, for the broker's placement (default: estimated at join)"
    )
    max_connections: int = option(512, help="open direct-plane connections, all callers together")
    max_caller_connections: int = option(32, help="open direct-plane connections of one caller identity")
    added_latency_ms: float = option(0.0, help="delay every request, to emulate a distant peer (benchmarks, tests)")
    handshake_timeout: float | None = option(
        None, hidden=True, help="tests: seconds a direct connection may take to be called (default: the timing's)"
    )
    probe_bytes: int = 4 * MIB  # the payload a joining peer times to estimate its link


@dataclass(frozen=True)
class ComputeConfig:
    """What runs the blocks and what one request or session may take of it."""

    device: str = option("cpu", help="where to serve: cpu, cuda, cuda:1, ...")
    runtime: str = option(
        "torch",
        parse=_runtime,
        metavar="torch|onnx",
        help="what runs the blocks: torch (inference, forward, backward, adapters) or onnx (ONNX Runtime on the "
        "CPU, Llama-family models in float32: inference and forward only; routes that train or carry adapters skip it)",
    )
    dtype: str | None = option(None, help="serving dtype (default: the model card's)")
    threads: int = option(1, help="compute threads, torch's or ONNX Runtime's (peers often share a machine's cores)")
    throughput: float | None = option(
        None,
        parse=_auto_or_float,
        show="auto",
        help="'auto' measures the span once and caches it; a number (forward tokens/s of ONE block) skips the probe",
    )
    cache_tokens: int = option(
        8192,
        help="KV-cache budget as tokens of context through this peer's largest span (batch x max_length, all "
        "sessions together), turned into bytes by the model family's cache layout",
    )
    cache_bytes: int | None = option(
        None,
        name="--cache-mb",
        parse=_mib,
        show="from --cache-tokens",
        metavar="MB",
        help="KV-cache budget in MiB instead (a session reserves what its family's caches take for its span)",
    )
    max_batch_tokens: int = option(8192, help="largest batch x sequence one request may carry")
    max_adapter_bytes: int = option(
        512 * MIB,
        name="--max-adapter-mb",
        parse=_mib,
        show="512",
        metavar="MB",
        help="room for clients' adapters and deep prompts, all clients together",
    )
    max_message_bytes: int = option(
        256 * MIB, name="--max-message-mb", parse=_mib, show="256", metavar="MB", help="a larger request is refused"
    )
    max_held_bytes: int = option(
        1024 * MIB,
        name="--max-held-mb",
        parse=_mib,
        show="1024",
        metavar="MB",
        help="bytes of requests held at once (arriving, queued or computing), all callers together; more is 'busy'",
    )
    max_kept_bytes: int = option(
        2048 * MIB,
        name="--max-kept-mb",
        parse=_mib,
        show="2048",
        metavar="MB",
        help="forward passes kept for a pending backward (what autograd saved), all callers together",
    )
    max_caller_kept_bytes: int = option(
        512 * MIB,
        name="--max-caller-kept-mb",
        parse=_mib,
        show="512",
        metavar="MB",
        help="...and for one caller (its oldest go first; beyond either, the client recomputes)",
    )
    max_caller_adapter_bytes: int = option(
        128 * MIB,
        name="--max-caller-adapter-mb",
        parse=_mib,
        show="128",
        metavar="MB",
        help="room for one caller's adapters (a larger upload is refused)",
    )
    max_sessions: int = option(128, help="open inference sessions, all callers together")
    max_caller_sessions: int = option(16, help="open inference sessions of one caller")
    caller_cache_share: float = option(0.5, help="share of the KV-cache budget one caller's sessions may reserve")
    max_queued: int = option(256, help="compute requests waiting for or running on the compute thread, all callers")
    max_caller_queued: int = option(32, help="...and of one caller (beyond either, a request is refused at once)")
    inline_tokens: int = option(8, help="inference steps of at most this many tokens run on the RPC loop")
    perturb_weights: float = option(0.0, hidden=True, help="tests: noise added to the weights after fingerprinting")


@dataclass(frozen=True)
class ObserveConfig:
    """What the peer shows about itself over HTTP (``peers.observe``): Prometheus metrics and the web dashboard."""

    http_host: str = option("127.0.0.1", help="address the metrics and dashboard ports listen on")
    metrics_port: int | None = option(
        None, parse=_port_or_off, show="off", help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free)"
    )
    dashboard_port: int | None = option(
        None, parse=_port_or_off, show="off", help="serve the swarm's live web dashboard here (0 = any free port)"
    )


@dataclass(frozen=True)
class PlacementConfig:
    """Which blocks the peer holds, and the broker's policy when this peer is the broker."""

    blocks: Span | None = option(
        None, parse=parse_span, metavar="A:B", help="pin this peer to a span (default: serve what the broker assigns)"
    )
    max_blocks: int | None = option(None, help="most blocks to hold (default: as many as memory allows)")
    broker: bool = option(True, help="never take the broker role")
    replication: int = option(1, help="broker policy: serving peers per block where possible")
    standby_fraction: float = option(0.1, help="broker policy: share of unpinned peers kept as warm standbys")


@dataclass(frozen=True)
class PeerConfig:
    """Everything ``python -m swarm.serve`` accepts."""

    model: str = option("smollm2-135m", help="a model card name (configs/models) or a Hugging Face folder")
    train: Path | None = option(
        None, metavar="RUN.toml", help="serve a trainable stage of this pre-training run (a run TOML file)"
    )
    checkpoint_dir: Path | None = option(None, help="where a trainable stage checkpoints (default: the run's)")
    cache_dir: Path = option(
        factory=default_cache_dir, parse=Path, show="~/.cache/swarm", help="converted models, identities, probes"
    )
    network: NetworkConfig = field(default_factory=NetworkConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    timing: Timing = field(default_factory=Timing)
    announce_failures: int = 3  # failed announce rounds in a row before a peer concludes it lost its DHT and leaves

    def check(self) -> None:
        net = self.network
        if net.new_swarm == bool(net.initial_peers):
            raise BadInputError("give --initial-peers of a running swarm, or --new-swarm to start one (not both)")
        if not 0 < self.compute.caller_cache_share <= 1:
            raise BadInputError(f"--caller-cache-share must lie in (0, 1], got {self.compute.caller_cache_share}")
        if self.compute.max_held_bytes < self.compute.max_message_bytes:
            raise BadInputError("--max-held-mb must be at least --max-message-mb: one largest request must fit")
