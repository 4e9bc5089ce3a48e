"""A peer's request counters, kept as it serves (``--metrics-port`` serves them, with the peer's state, through
``peers.metrics``), in a registry of its own: nothing is registered at import, and two peers in one process (tests)
never share a series.

Only what cannot be read from the peer's state is counted as it happens: requests by kind and outcome with their
latency (one ``observe`` per request, where the servicer answers it), the bytes the servicer receives and sends, the
requests served and in progress (``served``, ``active``: what ``info`` reports), and a few events the step pusher
sees. Labels take values from small fixed sets: never a caller's peer id, a session id or an
error text."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from peers.serving.limits import StreamStalled
from swarm import wire
from swarm.errors import SwarmError

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
        self.batch_rows = Histogram(
            "swarm_peer_batch_rows",
            "rows of each inference forward: steps of several sessions run together (continuous batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        for kind in ("forward", "backward", "session_open", "inference_step", "info"):  # a rate needs a series at 0
            self.requests.labels(kind, "ok")
            self.latency.labels(kind)
        # plain ints, added to on the RPC loop (and read there too: see ``PeerCollector``)
        self.served: collections.Counter[str] = collections.Counter()  # requests served by kind (info, records)
        self.active = 0  # requests being processed now (reported by info)
        self.received_bytes = 0  # every frame the servicer decoded, requests and pushes
        self.sent_bytes = 0  # every frame it answered with
        self.push_failures = 0  # push connections to a chained route's next hop that failed or were closed
        self.push_dropped = 0  # steps not pushed on because the next hop's queue was full
        self.step_replays = 0  # steps sent again from an earlier position: a client repaired its route upstream
        self.push_refused = 0  # pushed steps refused: not from the session's previous hop, no such session, bounds
        # chained training passes' pushes by outcome (``peers.rpc.passes.OUTCOMES``: taken, kept or why refused), and
        # the most pushes one pusher kept here at once waiting for their requests (its share bounds it)
        self.pass_pushes: collections.Counter[str] = collections.Counter()
        self.pass_early_peak = 0
        # accusations this peer judged as the broker (``peers.judge``): upheld, false (against the accuser), dropped
        self.accusations: collections.Counter[str] = collections.Counter()
        self.sessions_expired = 0  # inference sessions this server ended: their client went quiet (or stalled)
        self.prefix_reused = 0  # positions (rows x positions) answered from kept prefixes (``peers.serving.prefixes``)
        self.internal_errors = 0  # failures of the server's own: answered ``swarm_error``, or a connection dropped
        self.watched = False  # its registry reads the peer's state too (set once by ``peers.metrics.watch``)

    def observe(self, kind: object, error: BaseException | None, seconds: float) -> None:
        """One answered request: O(1), no allocation but the label lookup."""
        name = kind if isinstance(kind, str) and kind in KINDS else "unknown"
        self.requests.labels(name, outcome_of(error)).inc()
        self.latency.labels(name).observe(seconds)

    def decoder(self, max_bytes: int, budget: wire.ByteBudget | None, caller: str = "anonymous") -> wire.Decoder:
        return CountingDecoder(self, max_bytes, budget, caller)

    def sent(self, frames: list[wire.Frame]) -> list[wire.Frame]:
        self.sent_bytes += wire.encoded_size(frames)
        return frames


class CountingDecoder(wire.Decoder):
    """A decoder that adds every frame it is fed to the peer's received bytes (refused frames too: they arrived)."""

    def __init__(self, metrics: PeerMetrics, max_bytes: int, budget: wire.ByteBudget | None, caller: str) -> None:
        super().__init__(max_bytes, budget, caller)
        self._metrics = metrics

    def feed(self, frame: wire.Frame) -> wire.Message | None:
        before = self.total_bytes
        try:
            return super().feed(frame)
        finally:
            self._metrics.received_bytes += self.total_bytes - before
