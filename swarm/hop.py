"""A hop: one server and the blocks a call asks of it, with what the caller needs to reach it."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.ids import Span
from swarm.records import ServerRecord


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int
    maddrs: tuple[str, ...] = ()
    dtype: str = "float32"
    direct: str | None = None  # host:port of its plain-TCP data plane, if it offers one
    step_seconds: float = 0.0  # announced time of one single-token inference step over this hop's blocks
    token_seconds: float = 0.0  # announced forward time per token over this hop's blocks
    runtime: str = "torch"  # the server's execution runtime (peers.serving.runtime)
    network_mbps: float | None = None  # the server's announced link (codec choice's prior; None: unknown)
    punch_via: tuple[str, ...] = ()  # behind a NAT: reached directly by hole punching, with these observers
    fingerprint: str = ""  # the weights it serves (its record's; accusations name them)
    quantization: str = "none"  # the format of its blocks' linear weights (swarm.quantization)

    @classmethod
    def of(
        cls,
        r: ServerRecord,
        start: int | None = None,
        end: int | None = None,
        *,
        step_seconds: float = 0.0,
        token_seconds: float = 0.0,
    ) -> Hop:
        """A hop to the server of record ``r``, over blocks ``start:end`` (default: its whole span)."""
        return cls(
            r.peer_id,
            r.start if start is None else start,
            r.end if end is None else end,
            tuple(r.maddrs),
            r.dtype,
            r.direct_address,
            step_seconds,
            token_seconds,
            r.runtime,
            r.network_mbps,
            tuple(r.punch_via),
            r.fingerprint,
            r.quantization,
        )

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)
