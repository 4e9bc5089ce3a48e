"""What this peer runs on and how fast its span is, measured on the real device and cached per (weights, span,
device, dtype, threads) so restarts skip the probe."""

from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peers.serving.runtime import SpanRuntime
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.host import cpu_name
from swarm.records import ServerRecord
from swarm.rpc.remote import Remote


@dataclass(frozen=True)
class Hardware:
    device_name: str
    device_memory: int  # bytes


def probe_hardware(device: str) -> Hardware:
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return Hardware(props.name, props.total_memory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(f"cpu: {cpu_name()}", memory)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_throughput(backend: SpanRuntime, *, seq: int = 128, steps: int = 8) -> tuple[float, float]:
    """(forward tokens/s, single-token inference steps/s) of the whole span, in the runtime that serves it."""
    hidden_size, dev = backend.config.hidden_size, backend.device
    with torch.inference_mode():
        x = torch.randn(1, seq, hidden_size, dtype=backend.dtype, device=dev)
        backend.run(x, backend.span)  # warm-up
        _sync(dev)
        t0 = time.perf_counter()
        backend.run(x, backend.span)
        _sync(dev)
        forward_tps = seq / (time.perf_counter() - t0)
        cache = backend.new_cache()
        backend.run(x[:, :16], backend.span, cache=cache)
        one = x[:, :1]
        _sync(dev)
        t0 = time.perf_counter()
        for i in range(steps):
            backend.run(one, backend.span, cache=cache, past=16 + i)
        _sync(dev)
        inference_sps = steps / (time.perf_counter() - t0)
    return forward_tps, inference_sps


def cached_throughput(backend: SpanRuntime, cache_dir: Path, key: str) -> tuple[float, float]:
    path = cache_dir / "throughput" / f"{key}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return float(data["forward_tps"]), float(data["inference_sps"])
    forward_tps, inference_sps = measure_throughput(backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"forward_tps": forward_tps, "inference_sps": inference_sps}))
    os.replace(tmp, path)
    return forward_tps, inference_sps


def usable_memory(device: str) -> int:
    """Bytes this peer can give to blocks: 90% of free GPU memory, or half of the available RAM on CPU (the rest is
    for activations, KV caches and the other processes of a volunteer's machine)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free * 0.9)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", 0) // 2
    except OSError:
        return probe_hardware(device).device_memory // 2


async def estimate_link_mbps(
    remote: Remote, records: list[ServerRecord], own_peer_id: str, payload: int, timeout: float
) -> float | None:
    """A rough estimate of this peer's link: time a payload sent to one live peer over the path real traffic takes
    (direct TCP where allowed, else libp2p). None when no other peer answers (e.g. the first peer of a swarm)."""
    for r in records:
        if r.peer_id == own_peer_id:
            continue
        hop = Hop.of(r)
        try:
            await remote.send_payload(hop, 64 * 1024, timeout)  # connect and warm up
            seconds = await remote.send_payload(hop, payload, timeout)
        except SwarmError:
            continue
        return payload * 8 / seconds / 1e6
    return None


def trim_freed_memory() -> None:
    """Hand memory that is free inside the C allocator's heaps back to the system (glibc's ``malloc_trim``: the tops
    of heaps and whole free pages within them, in every thread's arena). Freed small objects leave pages behind that
    glibc keeps until asked; a server asks now and then, so a burst of attacks leaves no lasting footprint."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do
