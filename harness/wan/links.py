"""The WAN's timing model, free of I/O so it can be tested without root: when a packet leaves its sender's uplink,
when it reaches its receiver's downlink, and when it is handed to the receiver.

Every node has an access link of ``mbit`` each way (an uplink and a downlink, as a home line or a data-centre port
has), and any two nodes are a one-way delay apart. A packet is serialized on the sender's uplink, propagates for the
pair's delay (plus jitter), then is serialized on the receiver's downlink. Each link has a drop-tail queue bounded in
time: a packet that would wait longer than ``queue_s`` is dropped, as a router's buffer overflows, which is what
makes TCP back off at the configured rate instead of filling an endless queue.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Link:
    """One direction of one node's access link: a serializer with a drop-tail queue bounded in seconds."""

    bytes_per_s: float | None  # None: unlimited, no queue
    queue_s: float
    busy_until: float = 0.0  # when the last admitted packet finishes being serialized

    def admit(self, now: float, cost: int) -> float | None:
        """When a packet of ``cost`` bytes arriving at ``now`` has been sent, or None when the queue drops it."""
        if self.bytes_per_s is None:
            return now
        start = max(now, self.busy_until)
        if start - now > self.queue_s:
            return None
        self.busy_until = start + cost / self.bytes_per_s
        return self.busy_until


@dataclass
class Topology:
    """Links and delays of ``n`` nodes, with the randomness of jitter and loss in one seeded generator."""

    delay_s: list[list[float]]  # [src][dst] one-way propagation delay
    uplinks: list[Link]
    downlinks: list[Link]
    jitter_s: float = 0.0
    loss: float = 0.0
    seed: int | None = None
    # [src][dst] latest arrival so far: jitter delays a packet but never lets it overtake an earlier one of the
    # same pair, since reordering would make TCP retransmit and the emulator would add loss nobody configured.
    _last_arrival: dict[tuple[int, int], float] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def lost(self, segments: int) -> bool:
        """Whether a packet standing for ``segments`` segments is lost; the chance is that of losing any one of
        them, so the fraction of bytes lost matches ``loss`` whatever the packets' sizes."""
        if self.loss <= 0.0:
            return False
        return self._rng.random() < 1.0 - (1.0 - self.loss) ** segments

    def arrival(self, src: int, dst: int, now: float, cost: int) -> float | None:
        """When a packet sent by ``src`` at ``now`` reaches ``dst``'s downlink, or None when the uplink drops it."""
        sent = self.uplinks[src].admit(now, cost)
        if sent is None:
            return None
        delay = self.delay_s[src][dst]
        if self.jitter_s > 0.0:  # d ± jitter, uniformly (as netem's), so the mean delay stays d
            delay = max(delay + self._rng.uniform(-self.jitter_s, self.jitter_s), 0.0)
        at = sent + delay
        at = max(at, self._last_arrival.get((src, dst), 0.0))
        self._last_arrival[(src, dst)] = at
        return at

    def delivery(self, dst: int, arrived: float, cost: int) -> float | None:
        """When a packet that reached ``dst``'s downlink at ``arrived`` is handed to ``dst``, or None when dropped."""
        return self.downlinks[dst].admit(arrived, cost)
