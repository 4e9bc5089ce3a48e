"""Where a swarm meets a datacenter: swarm / datacenter throughput and cloud cost over a grid of link delays and
bandwidths (``crossover``), and the fewest swarm devices that match a datacenter over one link (``needed``). Pure
functions over ``swarm.perf.fleet``'s fleets."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.perf.catalogue import DeviceSpec
from swarm.perf.fleet import (
    Pretraining,
    Result,
    Serving,
    serve_datacenter,
    serve_swarm,
    train_datacenter,
    train_swarm,
)
from swarm.perf.model import Link


@dataclass(frozen=True)
class Crossover:
    """Swarm / datacenter over a grid: ``ratio[i][j]`` throughput and ``cost_ratio[i][j]`` cloud $ per token at
    ``delays[i]`` (s) and ``bandwidths[j]`` (bytes/s); per delay, the least bandwidth where the swarm matches the
    throughput (``match``) or is cheaper per token (``cheaper``), None where it never does on the grid."""

    bandwidths: tuple[float, ...]
    delays: tuple[float, ...]
    ratio: tuple[tuple[float, ...], ...]
    cost_ratio: tuple[tuple[float, ...], ...]
    match: tuple[float | None, ...]
    cheaper: tuple[float | None, ...]


def log_grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(lo * (hi / lo) ** (i / (n - 1)) for i in range(n))


def swarm_result(spec: DeviceSpec, count: int, link: Link, workload: Serving | Pretraining) -> Result:
    if isinstance(workload, Serving):
        return serve_swarm(spec, count, link, workload)
    return train_swarm(spec, count, link, workload)


def datacenter_result(spec: DeviceSpec, count: int, workload: Serving | Pretraining, gbps: float) -> Result:
    if isinstance(workload, Serving):
        return serve_datacenter(spec, count, workload, gbps)
    return train_datacenter(spec, count, workload, gbps)


def _first(grid: tuple[float, ...], row: tuple[float, ...], at_least: bool) -> float | None:
    return next((g for g, v in zip(grid, row, strict=True) if (v >= 1.0 if at_least else v <= 1.0)), None)


def crossover(
    swarm: DeviceSpec,
    swarm_count: int,
    dc: DeviceSpec,
    dc_count: int,
    workload: Serving | Pretraining,
    interconnect_gbps: float = 450.0,
    bandwidths: tuple[float, ...] = log_grid(10e6 / 8, 10e9 / 8, 25),
    delays: tuple[float, ...] = log_grid(1e-3, 0.2, 12),
) -> Crossover:
    ref = datacenter_result(dc, dc_count, workload, interconnect_gbps)
    ratio, cost = [], []
    for d in delays:
        row = [swarm_result(swarm, swarm_count, Link(delay=d, bandwidth=bw), workload) for bw in bandwidths]
        ratio.append(tuple(r.throughput / ref.throughput for r in row))
        cost.append(tuple(r.usd_per_mtok_cloud / ref.usd_per_mtok_cloud for r in row))
    return Crossover(
        bandwidths,
        delays,
        tuple(ratio),
        tuple(cost),
        tuple(_first(bandwidths, r, True) for r in ratio),
        tuple(_first(bandwidths, r, False) for r in cost),
    )


def needed(swarm: DeviceSpec, dc: Result, link: Link, workload: Serving | Pretraining, limit: int = 4096) -> int | None:
    """The fewest ``swarm`` devices whose throughput reaches ``dc``'s over ``link`` (None: not within ``limit``)."""

    def tput(n: int) -> float:
        try:
            return swarm_result(swarm, n, link, workload).throughput
        except ValueError:  # too few devices for one pipeline
            return 0.0

    lo, hi = 1, 64
    while tput(hi) < dc.throughput:
        if hi >= limit:
            return None
        lo, hi = hi, min(2 * hi, limit)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if tput(mid) < dc.throughput else (lo, mid)
    return lo
