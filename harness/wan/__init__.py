"""A WAN emulator for tests and benchmarks: nodes in network namespaces, any two a configured delay apart, each
with its own bandwidth (and optionally jitter and loss), joined by a user-space router over TUN devices. Any TCP
program runs unchanged inside a node. ``python -m harness.wan up|down|measure`` is its command line."""

from harness.wan.config import WanConfig
from harness.wan.emulator import Wan
from harness.wan.measure import measure_rtt, measure_throughput
from harness.wan.netns import WanError, unavailable_reason

__all__ = ["Wan", "WanConfig", "WanError", "measure_rtt", "measure_throughput", "unavailable_reason"]
