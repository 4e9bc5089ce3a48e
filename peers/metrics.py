"""A peer's Prometheus metrics (``--metrics-port``, served by ``peers.observe``), in a registry of its own: nothing
is registered at import, and two peers in one process (tests) never share a series.

Only what the registry cannot read from the peer is counted as it happens: requests by kind and outcome with their
latency (one ``observe`` per request, where the servicer answers it), the bytes the servicer receives and sends, and
a few events the relay sees. Everything else (KV cache, sessions, adapters, kept activations, the compute stats and
the peer's own calls' traffic) is read from the peer's existing state when Prometheus scrapes, so serving pays
nothing for it. Labels take values from small fixed sets: never a caller's peer id, a session id or an error text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from peers.rpc.limits import StreamStalled
from swarm import wire
from swarm.errors import SwarmError

if TYPE_CHECKING:
    from peers.node import Peer
    from swarm.rpc.remote import Remote

# What a request can be: the compute kinds of ``swarm.protocol.COMPUTE_REQUEST`` and the other RPCs.
KINDS = frozenset(
    {"forward", "backward", "release", "state", "step", "session_open", "inference_step", "info", "bandwidth"}
)
# Outcomes: ``ok`` or the code of a ``swarm.errors`` class (a fixed set); anything else is ``error``.
OUTCOMES = frozenset(
    {
        "ok",
        "bad_input",
        "version_mismatch",
        "missing_blocks",
        "cache_full",
        "session_length",
        "peer_unavailable",
        "activations_gone",
        "adapter_missing",
        "stale_step",
        "busy",
        "session_expired",
        "not_member",
    }
)
# Seconds: an inline single-token step takes ~1 ms on a CPU, a large forward or a session waiting for cache room
# seconds; the buckets span both.
SCRAPE_TIMEOUT = 10.0  # seconds a scrape waits for the RPC loop to read the peer's state
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def outcome_of(error: BaseException | None) -> str:
    """The outcome label of a request that raised ``error`` (None: it succeeded)."""
    if error is None:
        return "ok"
    # malformed metadata, or a stream stalled mid-message: the sender's fault (``peers.rpc.servicer.error_reply``)
    if isinstance(error, ValidationError | StreamStalled):
        return "bad_input"
    if isinstance(error, SwarmError):
        return error.code if error.code in OUTCOMES else "error"
    return "error"


class PeerMetrics:
    """The counters a peer keeps as it serves, and the registry a scrape reads (after ``watch``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "swarm_peer_requests", "requests answered, by kind and outcome", ["kind", "outcome"], registry=self.registry
        )
        self.latency = Histogram(
            "swarm_peer_request_seconds",
            "seconds from a request's arrival to its answer",
            ["kind"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        for kind in ("forward", "backward", "session_open", "inference_step", "info"):  # a rate needs a series at 0
            self.requests.labels(kind, "ok")
            self.latency.labels(kind)
        # plain ints, added to on the RPC loop (and read there too: see ``PeerCollector``)
        self.received_bytes = 0  # every frame the servicer decoded, requests and pushes
        self.sent_bytes = 0  # every frame it answered with
        self.push_failures = 0  # push connections to a chained route's next hop that failed or were closed
        self.push_dropped = 0  # steps not pushed on because the next hop's queue was full
        self.step_replays = 0  # steps sent again from an earlier position: a client repaired its route upstream
        self.push_refused = 0  # pushed steps refused: not from the session's previous hop, no such session, bounds
        self.sessions_expired = 0  # inference sessions this server ended: their client went quiet (or stalled)
        self.internal_errors = 0  # failures of the server's own: answered ``swarm_error``, or a connection dropped
        self._watching = False

    def observe(self, kind: object, error: BaseException | None, seconds: float) -> None:
        """One answered request: O(1), no allocation but the label lookup."""
        name = kind if isinstance(kind, str) and kind in KINDS else "unknown"
        self.requests.labels(name, outcome_of(error)).inc()
        self.latency.labels(name).observe(seconds)

    def decoder(self, max_bytes: int, budget: wire.ByteBudget | None) -> wire.Decoder:
        return CountingDecoder(self, max_bytes, budget)

    def sent(self, frames: list[wire.Frame]) -> list[wire.Frame]:
        self.sent_bytes += wire.encoded_size(frames)
        return frames

    def watch(
        self, peer: Peer, remote: Remote | None, loop: asyncio.AbstractEventLoop | None = None
    ) -> CollectorRegistry:
        """Add the peer's state, read at scrape time (on ``loop``, the RPC loop, if given), to the registry (once)
        and return the registry."""
        if not self._watching:
            self.registry.register(PeerCollector(peer, remote, self, loop))
            self._watching = True
        return self.registry


class CountingDecoder(wire.Decoder):
    """A decoder that adds every frame it is fed to the peer's received bytes (refused frames too: they arrived)."""

    def __init__(self, metrics: PeerMetrics, max_bytes: int, budget: wire.ByteBudget | None) -> None:
        super().__init__(max_bytes, budget)
        self._metrics = metrics

    def feed(self, frame: wire.Frame) -> wire.Message | None:
        before = self.total_bytes
        try:
            return super().feed(frame)
        finally:
            self._metrics.received_bytes += self.total_bytes - before


class PeerCollector(Collector):
    """The peer's state as metrics, read when Prometheus scrapes. The scrape runs on the HTTP server's thread while
    the RPC loop changes that state (sums over the adapter cache's dict, for one), so the reading itself is handed to
    the loop: one short callback per scrape, and no read ever races a change."""

    def __init__(
        self, peer: Peer, remote: Remote | None, metrics: PeerMetrics, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.peer, self.remote, self.metrics, self.loop = peer, remote, metrics, loop

    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            return iter(self.read())

        async def on_loop() -> list[Metric]:
            return self.read()

        return iter(asyncio.run_coroutine_threadsafe(on_loop(), loop).result(SCRAPE_TIMEOUT))

    def read(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        peer, m = self.peer, self.metrics
        compute, budget = peer.compute, peer.sessions.budget
        span = peer.span
        info = InfoMetricFamily("swarm_peer", "this peer: its id, model, span, role and state")
        info.add_metric(
            [],
            {
                "peer_id": peer.peer_id,
                "model": peer.model.name,
                "span": str(span) if span else "",
                "role": peer.role.value if peer.role else "",
                "state": peer.state.value,
            },
        )
        yield info
        yield _gauge("swarm_peer_span_start", "first block held (-1: none)", span.start if span else -1)
        yield _gauge("swarm_peer_span_end", "block after the last one held (-1: none)", span.end if span else -1)
        yield _gauge("swarm_peer_cache_bytes_total", "KV-cache budget in bytes", budget.total)
        yield _gauge("swarm_peer_cache_bytes_used", "KV-cache bytes reserved by open sessions", budget.used)
        yield _gauge("swarm_peer_cache_bytes_free", "KV-cache bytes free for new sessions", budget.free)
        tokens = peer.sessions.tokens(budget.free, span)
        yield _gauge("swarm_peer_cache_tokens_free", "tokens of context the free cache holds through the span", tokens)
        yield _gauge("swarm_peer_open_sessions", "inference sessions open now", len(peer.sessions.open))
        yield _gauge("swarm_peer_active_requests", "compute requests and steps being processed now", compute.active)
        yield _gauge("swarm_peer_kept_activations", "forward passes kept for a pending backward", len(compute.kept))
        yield _gauge("swarm_peer_adapter_clients", "clients whose adapters are cached", len(compute.adapters))
        yield _gauge("swarm_peer_adapter_bytes", "bytes of cached adapters", compute.adapters.nbytes)
        stats = dict(compute.stats)
        for name, key, text in (
            ("adapter_uploads", "adapter_uploads", "adapters uploaded (and parsed) with a request"),
            ("not_kept", "not_kept", "forward passes not kept for backward (over the caps: the client recomputes)"),
            ("sessions_opened", "sessions", "inference sessions opened"),
        ):
            yield _counter(f"swarm_peer_{name}", text, stats.get(key, 0))
        yield _counter("swarm_peer_span_loads", "spans loaded from disk", peer.span_loads)
        yield _counter("swarm_peer_push_failures", "push connections to a next hop that failed", m.push_failures)
        yield _counter("swarm_peer_push_dropped", "steps not pushed: the next hop's queue was full", m.push_dropped)
        yield _counter(
            "swarm_peer_step_replays", "steps sent again after the client repaired its route upstream", m.step_replays
        )
        yield _counter("swarm_peer_push_refused", "pushed steps refused (not from the previous hop)", m.push_refused)
        yield _counter(
            "swarm_peer_sessions_expired",
            "inference sessions ended by this server: idle or stalled",
            m.sessions_expired,
        )
        yield _counter(
            "swarm_peer_internal_errors", "requests that failed on the server's own error", m.internal_errors
        )
        traffic = CounterMetricFamily(
            "swarm_peer_bytes",
            "bytes on the wire: as a server (requests received, replies sent) and as a client (this peer's own calls)",
            labels=["role", "direction"],
        )
        traffic.add_metric(["server", "received"], m.received_bytes)
        traffic.add_metric(["server", "sent"], m.sent_bytes)
        own = dict(self.remote.traffic) if self.remote is not None else {}
        traffic.add_metric(["client", "received"], own.get("received_bytes", 0))
        traffic.add_metric(["client", "sent"], own.get("sent_bytes", 0))
        yield traffic


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # this thread runs no loop (the HTTP server's)
        return None
