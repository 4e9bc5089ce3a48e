"""What this party knows of its link to each peer: a bandwidth estimate in megabits per second, for choosing
activation codecs (``swarm.codecs.choose_codec``).

The prior is what the peer announced (``ServerRecord.network_mbps``: declared by its operator or timed once at its
start); each large enough exchange then adds a sample, bytes moved both ways over the call's wall time, smoothed by
an exponential moving average. A call's time includes the server's compute, so a sample is a lower bound of the
link: small messages, where compute and latency dominate, are not sampled at all, and on large ones the bias errs
toward compressing (a little CPU, never a wrong result beyond the codec's own error)."""

from __future__ import annotations

MIN_SAMPLE_BYTES = 256 * 1024  # below this a call's time says more about latency and compute than about bandwidth
MAX_PEERS = 4096  # peers remembered (ids come from records anyone writes: bounded)


class Links:
    def __init__(self, smoothing: float = 0.3, min_sample_bytes: int = MIN_SAMPLE_BYTES) -> None:
        self.smoothing = smoothing  # weight of the newest sample
        self.min_sample_bytes = min_sample_bytes
        self._mbps: dict[str, float] = {}

    def mbps(self, peer_id: str, prior: float | None = None) -> float | None:
        """The estimate for ``peer_id``: smoothed samples, else ``prior`` (None: unknown)."""
        return self._mbps.get(peer_id, prior if prior is not None and prior > 0 else None)

    def observe(self, peer_id: str, nbytes: int, seconds: float, prior: float | None = None) -> None:
        """One exchange of ``nbytes`` (request and reply) that took ``seconds``."""
        if nbytes < self.min_sample_bytes or not seconds > 0:
            return
        sample = nbytes * 8 / seconds / 1e6
        old = self.mbps(peer_id, prior)
        if old is None and len(self._mbps) >= MAX_PEERS:
            self._mbps.clear()  # forgetting costs a few samples' accuracy, nothing else
        self._mbps[peer_id] = sample if old is None else old + self.smoothing * (sample - old)
