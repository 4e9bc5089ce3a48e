"""A WAN emulator for tests and benchmarks: nodes in network namespaces, any two a configured delay apart, each
with its own bandwidth (and optionally jitter and loss), joined by a user-space router over TUN devices. Any TCP
program runs unchanged inside a node. ``python -m swarm.wan up|down|measure`` is its command line."""

from swarm.wan.config import WanConfig
from swarm.wan.emulator import Wan
from swarm.wan.measure import measure_rtt, measure_throughput
from swarm.wan.netns import WanError, unavailable_reason

__all__ = ["Wan", "WanConfig", "WanError", "measure_rtt", "measure_throughput", "unavailable_reason"]
