"""The API server's Prometheus metrics, in a registry of its own (nothing registered at import; two servers in one
process never share a series). The HTTP layer calls ``request`` around each request, ``first_token`` and ``tokens``
while it streams, ``failover`` when the client repaired a route, and serves ``render()`` at ``/metrics``. Labels
take values from fixed sets: an endpoint or outcome outside them is counted as ``other`` / ``error``, so a caller
cannot grow the number of series."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

ENDPOINTS = ("chat", "completions", "models", "other")
OUTCOMES = (
    "ok",
    "bad_request",
    "unauthorized",
    "not_found",
    "too_many",
    "unavailable",
    "context_too_long",
    "error",
    "timeout",
    "client_closed",
)
CUT_REASONS = ("header_timeout", "write_timeout", "evicted", "refused")  # why the server cut a connection
# Whole requests: a models listing takes milliseconds, a long generation over a WAN swarm minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
Traffic = Callable[[], Mapping[str, int]]  # e.g. the client's ``Remote.traffic``: sent_bytes, received_bytes


class Outcome:
    """What ``ApiMetrics.request`` yields: set ``value`` to the request's outcome before the block ends (a block
    left by an exception without one is counted as ``error``)."""

    def __init__(self) -> None:
        self.value: str | None = None


class ApiMetrics:
    def __init__(self, traffic: Traffic | None = None) -> None:
        """``traffic``: read at scrape time for the bytes the API's swarm client sent and received."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "swarm_api_requests", "API requests answered, by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.latency = Histogram(
            "swarm_api_request_seconds",
            "seconds from a request's arrival to its last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "swarm_api_time_to_first_token_seconds",
            "seconds from a generation request's arrival to its first token",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.generated = Counter("swarm_api_tokens_generated", "tokens generated", ["endpoint"], registry=r)
        self.prompt = Counter("swarm_api_prompt_tokens", "prompt tokens received", ["endpoint"], registry=r)
        self.in_flight = Gauge("swarm_api_requests_in_flight", "API requests being answered now", registry=r)
        self.failovers = Counter("swarm_api_failovers", "times the swarm client replaced a failed peer", registry=r)
        self.cuts = Counter(
            "swarm_api_connections_cut", "connections the server cut, by reason", ["reason"], registry=r
        )
        for reason in CUT_REASONS:
            self.cuts.labels(reason)
        if traffic is not None:
            r.register(_TrafficCollector(traffic))
        for endpoint in ENDPOINTS[:3]:  # the series exist from the start: a rate over them needs no first request
            self.requests.labels(endpoint, "ok")
            self.latency.labels(endpoint)

    @contextmanager
    def request(self, endpoint: str) -> Iterator[Outcome]:
        """Count and time one request: ``with metrics.request("chat") as outcome: ...; outcome.value = "ok"``."""
        name = _endpoint(endpoint)
        outcome = Outcome()
        self.in_flight.inc()
        t0 = time.perf_counter()
        try:
            yield outcome
        except BaseException:
            outcome.value = outcome.value or "error"
            raise
        finally:
            self.in_flight.dec()
            self.latency.labels(name).observe(time.perf_counter() - t0)
            self.requests.labels(name, _outcome(outcome.value or "ok")).inc()

    def observe(self, endpoint: str, outcome: str, seconds: float) -> None:
        """One request counted after the fact (for a layer that times requests itself)."""
        name = _endpoint(endpoint)
        self.requests.labels(name, _outcome(outcome)).inc()
        self.latency.labels(name).observe(seconds)

    def first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(_endpoint(endpoint)).observe(seconds)

    def tokens(self, endpoint: str, generated: int, prompt: int = 0) -> None:
        name = _endpoint(endpoint)
        if generated:
            self.generated.labels(name).inc(generated)
        if prompt:
            self.prompt.labels(name).inc(prompt)

    def failover(self, count: int = 1) -> None:
        self.failovers.inc(count)

    def connection_cut(self, reason: str) -> None:
        self.cuts.labels(reason if reason in CUT_REASONS else "refused").inc()

    def watch_connections(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """``counts``: the open connections by state (pending, authenticated), read at scrape time."""
        self.registry.register(_ConnectionsCollector(counts))

    def render(self) -> tuple[bytes, str]:
        """The body and content type of ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _endpoint(name: str) -> str:
    return name if name in ENDPOINTS else "other"


def _outcome(name: str) -> str:
    return name if name in OUTCOMES else "error"


class _TrafficCollector(Collector):
    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic

    def collect(self) -> Iterator[Metric]:
        counts = dict(self.traffic())  # one copy: the client's loop thread may add to it meanwhile
        family = CounterMetricFamily(
            "swarm_api_swarm_bytes", "bytes the API's swarm client exchanged with peers", labels=["direction"]
        )
        family.add_metric(["sent"], counts.get("sent_bytes", 0))
        family.add_metric(["received"], counts.get("received_bytes", 0))
        yield family


class _ConnectionsCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "swarm_api_connections", "open HTTP connections, by whether they showed an API key", labels=["state"]
        )
        for state, n in sorted(self.counts().items()):
            family.add_metric([state], n)
        yield family
