"""This machine's calibration, the cost model's measured parameters: a versioned record (``Calibration``) written as
JSON next to the other caches (``SWARM_CACHE_DIR``), keyed by the CPU, torch's version and the thread count.

The product only reads it (``python -m swarm.perf show|predict``); the harness measures it
(``python -m harness.perf calibrate``, see ``harness/perf/calibrate.py`` for what each number is)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarm.host import cpu_name
from swarm.perf.model import Device, Link, Software

CALIBRATION_VERSION: Literal[1] = 1
# wire bytes per value (the 8-bit codebooks' 1 KiB per tensor left out)
CODEC_BYTES = {"none": 4.0, "float16": 2.0, "bfloat16": 2.0, "block8": 1.0 + 9 / 128, "uint8": 1.0, "quantile8": 1.0}


class Hardware(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    flops: float = Field(gt=0)  # FLOP/s, float32 linear layer
    attention_flops: float = Field(gt=0)  # FLOP/s, causal attention
    bandwidth: float = Field(gt=0)  # bytes/s, streamed
    elementwise_bandwidth: float = Field(gt=0)  # bytes/s read and written by element-wise kernels
    stream_curve: tuple[tuple[float, float], ...] = ()  # (matrix bytes, bytes/s) of one token through such matrices
    block_overhead: float = Field(ge=0)  # s per block forward call
    backward_overhead: float = Field(ge=0)  # s per block backward (input gradients only)
    weights_backward_overhead: float = Field(default=0.0, ge=0)  # ...with weight gradients too (pre-training)
    optimizer_overhead: float = Field(default=0.0, ge=0)  # s per parameter tensor of an AdamW step


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    version: Literal[1] = CALIBRATION_VERSION
    machine: str
    threads: int = Field(gt=0)
    hardware: Hardware
    transport_bandwidth: float = Field(gt=0)  # bytes/s through the swarm's transport on loopback
    software: dict[str, float]  # swarm.perf.model.Software's fields
    codecs: dict[str, tuple[float, float]] = {}  # codec -> (s per tensor, s per float32 byte): compress + decompress
    measured_at: float

    def device(self, name: str = "this machine (calibrated)") -> Device:
        h = self.hardware
        return Device(
            name,
            h.flops,
            h.bandwidth,
            4.0,
            h.block_overhead,
            h.backward_overhead,
            weights_backward_overhead=h.weights_backward_overhead,
            optimizer_overhead=h.optimizer_overhead,
            attention_flops=h.attention_flops,
            elementwise_bandwidth=h.elementwise_bandwidth,
            stream_curve=h.stream_curve,
        )

    def link(self, delay: float = 0.0, wire: float = math.inf, codec: str = "none") -> Link:
        """A link of one-way ``delay`` and ``wire`` bytes/s (none: loopback) as this machine's transport drives it:
        the slower of the wire and the transport's own rate per byte, with ``codec``'s bytes and CPU time."""
        fixed, per_byte = self.codecs.get(codec, (0.0, 0.0))
        bandwidth = 1.0 / (1.0 / wire + 1.0 / self.transport_bandwidth)
        return Link(
            delay, bandwidth, ratio=CODEC_BYTES.get(codec, 4.0) / 4.0, codec_fixed=fixed, codec_per_byte=per_byte
        )

    def costs(self) -> Software:
        return Software(**{k: max(v, 0.0) for k, v in self.software.items()})


def machine_key(threads: int) -> str:
    import torch

    return f"{cpu_name()} | torch {torch.__version__} | {threads} thread(s)"


def calibration_path(cache_dir: Path, threads: int) -> Path:
    digest = hashlib.sha256(machine_key(threads).encode()).hexdigest()[:16]
    return cache_dir / "perf" / f"calibration-{digest}.json"


def cached_software(cache_dir: Path) -> Software | None:
    """The swarm's fixed costs from this machine's newest calibration, measured with any thread count (they are the
    protocol's and the event loops', not the kernels'); None where this machine was never calibrated."""
    here = machine_key(1).rsplit(" | ", 1)[0]  # the CPU and torch's version
    found = [c for p in sorted((cache_dir / "perf").glob("calibration-*.json")) if (c := load(p)) is not None]
    mine = [c for c in found if c.machine.rsplit(" | ", 1)[0] == here]
    return max(mine, key=lambda c: c.measured_at).costs() if mine else None


def load(path: Path) -> Calibration | None:
    try:
        return Calibration.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def save(cal: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cal.model_dump(), indent=1))
    os.replace(tmp, path)
