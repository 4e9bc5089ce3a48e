"""A peer's Prometheus metrics (``--metrics-port``, served by ``peers.observe``): its request counters
(``peers.serving.counters``) and its state, read when Prometheus scrapes from a frozen ``PeerSnapshot`` the peer
takes on its RPC loop, so serving pays nothing for it and the collector never touches the peer itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from peers.serving.counters import PeerMetrics
from swarm.ids import Span

SCRAPE_TIMEOUT = 10.0  # seconds a scrape waits for the RPC loop to take the peer's snapshot


@dataclass(frozen=True)
class PeerSnapshot:
    """A peer's state at one instant, as metrics read it (``peers.node.Peer.snapshot``, taken on the RPC loop)."""

    peer_id: str
    model: str
    span: Span | None
    role: str  # "" before the peer holds a span
    state: str
    cache_bytes_total: int
    cache_bytes_used: int
    cache_tokens_free: int  # tokens of context the free cache holds through the span
    open_sessions: int
    active_requests: int
    kept_activations: int
    adapter_clients: int
    adapter_bytes: int
    adapter_uploads: int
    not_kept: int
    sessions_opened: int
    span_loads: int
    client_sent_bytes: int  # the peer's own calls (as a client of other peers)
    client_received_bytes: int
    relay_slots: int = 0  # --relay: peers holding a slot here now
    relay_circuits: int = 0  # ...connections relayed, in all
    relay_bytes: int = 0  # ...bytes relayed, both ways
    punched: int = 0  # behind a NAT: direct connections opened by hole punching
    punched_out: int = 0  # ...and those it opened itself to NAT'd peers (its chained pushes, its own calls)
    averaging_bytes: int = 0  # a trainable stage: bytes sent to its replicas in averaging rounds
    rounds_undone: int = 0  # ...averaging rounds whose result it undid
    replica_heals: int = 0  # ...fresh state copies it took after it was found apart from its replicas
    prefix_bytes: int = 0  # KV-cache bytes kept prefixes and open sessions' trails hold (given back on demand)


Snapshot = Callable[[], PeerSnapshot]


def watch(
    counters: PeerMetrics, snapshot: Snapshot, loop: asyncio.AbstractEventLoop | None = None
) -> CollectorRegistry:
    """Add the peer's state, taken by ``snapshot`` at scrape time (on ``loop``, the RPC loop, if given), to the
    counters' registry (once) and return the registry."""
    if not counters.watched:
        counters.registry.register(PeerCollector(snapshot, counters, loop))
        counters.watched = True
    return counters.registry


class PeerCollector(Collector):
    """The peer's state as metrics, read when Prometheus scrapes. The scrape runs on the HTTP server's thread while
    the RPC loop changes that state (sums over the adapter cache's dict, for one), so the snapshot is taken on the
    loop: one short callback per scrape, and no read ever races a change."""

    def __init__(
        self, snapshot: Snapshot, counters: PeerMetrics, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.snapshot, self.counters, self.loop = snapshot, counters, loop

    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            return iter(families(self.snapshot(), self.counters))

        async def on_loop() -> PeerSnapshot:
            return self.snapshot()

        snap = asyncio.run_coroutine_threadsafe(on_loop(), loop).result(SCRAPE_TIMEOUT)
        return iter(families(snap, self.counters))


def families(s: PeerSnapshot, m: PeerMetrics) -> list[Metric]:
    span = s.span
    info = InfoMetricFamily("swarm_peer", "this peer: its id, model, span, role and state")
    labels = {"peer_id": s.peer_id, "model": s.model, "span": str(span) if span else "", "role": s.role}
    info.add_metric([], labels | {"state": s.state})
    traffic = CounterMetricFamily(
        "swarm_peer_bytes",
        "bytes on the wire: as a server (requests received, replies sent) and as a client (this peer's own calls)",
        labels=["role", "direction"],
    )
    traffic.add_metric(["server", "received"], m.received_bytes)
    traffic.add_metric(["server", "sent"], m.sent_bytes)
    traffic.add_metric(["client", "received"], s.client_received_bytes)
    traffic.add_metric(["client", "sent"], s.client_sent_bytes)
    traffic.add_metric(["averaging", "sent"], s.averaging_bytes)
    return [
        info,
        _gauge("swarm_peer_span_start", "first block held (-1: none)", span.start if span else -1),
        _gauge("swarm_peer_span_end", "block after the last one held (-1: none)", span.end if span else -1),
        _gauge("swarm_peer_cache_bytes_total", "KV-cache budget in bytes", s.cache_bytes_total),
        _gauge("swarm_peer_cache_bytes_used", "KV-cache bytes reserved by open sessions", s.cache_bytes_used),
        _gauge(
            "swarm_peer_cache_bytes_free",
            "KV-cache bytes free for new sessions",
            s.cache_bytes_total - s.cache_bytes_used,
        ),
        _gauge(
            "swarm_peer_cache_tokens_free",
            "tokens of context the free cache holds through the span",
            s.cache_tokens_free,
        ),
        _gauge(
            "swarm_peer_prefix_kept_bytes",
            "KV-cache bytes held by kept prefixes and the trails of sessions to keep (evictable)",
            s.prefix_bytes,
        ),
        _counter(
            "swarm_peer_prefix_reused_tokens",
            "positions answered from kept prefixes instead of computed",
            m.prefix_reused,
        ),
        _gauge("swarm_peer_open_sessions", "inference sessions open now", s.open_sessions),
        _gauge("swarm_peer_active_requests", "compute requests and steps being processed now", s.active_requests),
        _gauge("swarm_peer_kept_activations", "forward passes kept for a pending backward", s.kept_activations),
        _gauge("swarm_peer_adapter_clients", "clients whose adapters are cached", s.adapter_clients),
        _gauge("swarm_peer_adapter_bytes", "bytes of cached adapters", s.adapter_bytes),
        _counter("swarm_peer_adapter_uploads", "adapters uploaded (and parsed) with a request", s.adapter_uploads),
        _counter(
            "swarm_peer_not_kept",
            "forward passes not kept for backward (over the caps: the client recomputes)",
            s.not_kept,
        ),
        _counter("swarm_peer_sessions_opened", "inference sessions opened", s.sessions_opened),
        _gauge("swarm_peer_relay_slots", "peers behind NAT holding a relay slot here (--relay)", s.relay_slots),
        _counter("swarm_peer_relay_circuits", "connections relayed for peers behind NAT", s.relay_circuits),
        _counter("swarm_peer_relay_bytes", "bytes relayed for peers behind NAT, both ways", s.relay_bytes),
        _counter("swarm_peer_punched", "direct connections to this peer opened by hole punching", s.punched),
        _counter(
            "swarm_peer_punched_out",
            "direct connections this peer opened to peers behind NAT by hole punching (chained pushes)",
            s.punched_out,
        ),
        _counter("swarm_peer_span_loads", "spans loaded from disk", s.span_loads),
        _counter("swarm_peer_rounds_undone", "averaging rounds whose result this replica undid", s.rounds_undone),
        _counter(
            "swarm_peer_replica_heals",
            "fresh state copies taken from the replicas after this one was found apart from them",
            s.replica_heals,
        ),
        _counter("swarm_peer_push_failures", "push connections to a next hop that failed", m.push_failures),
        _counter("swarm_peer_push_dropped", "steps not pushed: the next hop's queue was full", m.push_dropped),
        _counter(
            "swarm_peer_step_replays", "steps sent again after the client repaired its route upstream", m.step_replays
        ),
        _counter("swarm_peer_push_refused", "pushed steps refused (not from the previous hop)", m.push_refused),
        _pass_pushes(m),
        _labelled(
            "swarm_peer_accusations_judged",
            "accusations this peer judged as the broker: upheld (the accused left out of placement), false "
            "(the accuser ignored from then on), dropped undecided",
            m.accusations,
        ),
        _gauge(
            "swarm_peer_pass_push_early_peak",
            "the most chained-pass pushes one pusher kept here at once before their requests came",
            m.pass_early_peak,
        ),
        _counter(
            "swarm_peer_sessions_expired",
            "inference sessions ended by this server: idle or stalled",
            m.sessions_expired,
        ),
        _counter("swarm_peer_internal_errors", "requests that failed on the server's own error", m.internal_errors),
        traffic,
    ]


def _pass_pushes(m: PeerMetrics) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "swarm_peer_pass_pushes",
        "chained training passes' pushes: taken by their request, kept for it, or refused (by reason)",
        labels=["outcome"],
    )
    for outcome, n in sorted(m.pass_pushes.items()):  # labels from the fixed set of ``peers.rpc.passes.OUTCOMES``
        family.add_metric([outcome], n)
    return family


def _labelled(name: str, text: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=["outcome"])
    for outcome, n in sorted(counts.items()):  # labels from a fixed set of the code's own
        family.add_metric([outcome], n)
    return family


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # this thread runs no loop (the HTTP server's)
        return None
