"""A volunteer peer's configuration, by concern; every field is also the flag of ``python -m swarm.serve`` that sets
it (``swarm.cli``), so each default is written once, here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from peers.serving.config import MIB, ComputeConfig
from swarm.cli import option
from swarm.config import Timing, default_cache_dir
from swarm.errors import BadInputError
from swarm.ids import Span, parse_span
from swarm.relay import CIRCUIT, MAX_RELAYS, REACHABILITY, Reachability, RelayPolicy


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


def _reachability(text: str) -> Reachability:
    for known in REACHABILITY:
        if text == known:
            return known
    raise BadInputError(f"--reachability is one of {', '.join(REACHABILITY)}, got {text!r}")


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
    max_connections: int = option(
        512, help="open connections (direct plane) and open streams (libp2p), each, all callers together"
    )
    max_caller_connections: int = option(64, help="...and of one caller identity")
    reachability: Reachability = option(
        "auto",
        parse=_reachability,
        help="auto (other peers dial back to find out), public, or private (behind NAT: reached through relays)",
    )
    relay: bool = option(False, help="offer relaying to peers behind NAT (public peers), within the bounds below")
    relay_max_reservations: int = option(16, help="...peers that may hold a relay slot here at once")
    relay_max_per_range: int = option(
        4, help="...of them from one address range (a public IPv4 /24 or IPv6 /48; one host elsewhere)"
    )
    relay_max_circuits: int = option(4, help="...relayed connections per peer")
    relay_mb: int = option(64, help="...MiB relayed each way per connection before it is reset")
    relay_time_s: int = option(600, help="...seconds a relayed connection may last")
    relay_via: tuple[str, ...] = option(
        (), metavar="MADDR", help="private peers: hold relay slots on these peers (default: the --initial-peers)"
    )
    added_latency_ms: float = option(0.0, help="delay every request, to emulate a distant peer (benchmarks, tests)")
    handshake_timeout: float | None = option(
        None, hidden=True, help="tests: seconds a direct connection may take to be called (default: the timing's)"
    )
    probe_bytes: int = 4 * MIB  # the payload a joining peer times to estimate its link

    def _relays(self) -> tuple[str, ...]:
        """Where a private peer reserves: ``--relay-via``, else the initial peers reached directly (a relayed one's
        relay is already among them, or was not told to this peer), the first ``MAX_RELAYS``."""
        return self.relay_via or tuple(p for p in self.initial_peers if CIRCUIT not in p)[:MAX_RELAYS]

    def relay_policy(self) -> RelayPolicy:
        return RelayPolicy(
            reachability=self.reachability,
            offer=self.relay,
            max_reservations=self.relay_max_reservations,
            max_per_range=self.relay_max_per_range,
            max_circuits=self.relay_max_circuits,
            data_bytes=self.relay_mb * MIB,
            time_s=self.relay_time_s,
            relays=self._relays() if self.reachability == "private" else (),
        )


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
        try:
            net.relay_policy()
        except ValueError as e:  # a relay bound that is not positive, a relay that is no full address
            raise BadInputError(f"--relay-*: {e}") from None
        if not 0 < self.compute.caller_cache_share <= 1:
            raise BadInputError(f"--caller-cache-share must lie in (0, 1], got {self.compute.caller_cache_share}")
        c = self.compute
        if min(c.max_held_bytes, c.max_caller_held_bytes) < c.max_message_bytes:
            raise BadInputError(
                "--max-held-mb and --max-caller-held-mb must be at least --max-message-mb: one largest request must fit"
            )
        if c.max_memory_bytes is not None and c.max_memory_bytes < 64 * MIB:
            raise BadInputError("--max-memory-mb below 64 leaves no room to serve")
