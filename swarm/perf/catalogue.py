"""The hardware catalogue: one TOML file per device in ``configs/hardware``, every number with its source and date.

``load_catalogue()`` reads the folder into frozen :class:`DeviceSpec` objects keyed by file stem; ``lookup()`` picks the
entry for a torch device name (``torch.cuda.get_device_name()``) by the longest matching substring.
"""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Dtype = Literal["float32", "float16", "bfloat16", "int8"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
_DTYPE_BY_NAME: dict[str, Dtype] = {d: d for d in DTYPES}


def _catalogue_dir() -> Path:
    """``configs/hardware`` next to this code in a source checkout, else the installed ``swarm_configs`` package data.

    The checkout comes first so that a git worktree reads its own files even when an editable install of another
    checkout provides ``swarm_configs``; a wheel install has no ``configs`` folder above the package and uses the spec.
    """
    repo = Path(__file__).resolve().parents[2] / "configs" / "hardware"
    if repo.is_dir():
        return repo
    spec = importlib.util.find_spec("swarm_configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / "hardware"
    return repo


CATALOGUE_DIR: Path = _catalogue_dir()


class Sourced(BaseModel):
    """One number, where it comes from (a named document) and the month of that document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: Annotated[float, Field(gt=0)]
    source: Annotated[str, Field(min_length=1, max_length=300)]
    date: Annotated[str, Field(pattern=r"^\d{4}-\d{2}$")]


class Numbers(BaseModel):
    """A device's sizes, rates, prices and measured-in-practice factors (units in the field names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_gb: Sourced  # device memory, 1e9 bytes
    memory_gbps: Sourced  # memory bandwidth, 1e9 bytes/s
    host_link_gbps: Sourced  # host link each way, 1e9 bytes/s
    power_w: Sourced  # board power / TDP
    price_usd: Sourced  # purchase price
    cloud_usd_per_hour: Sourced  # on-demand rental of one device
    matmul_efficiency: Sourced  # fraction of peak a large 16-bit GEMM reaches
    memory_efficiency: Sourced  # fraction of peak bandwidth a streaming kernel reaches
    launch_overhead_us: Sourced  # per-op launch/dispatch overhead in eager PyTorch


class DeviceSpec(BaseModel):
    """One catalogue entry; the properties give the numbers in SI units (FLOP/s, bytes, bytes/s, seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(min_length=1)]
    match: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1)]
    kind: Literal["gpu", "cpu"]
    peak_tflops: dict[Dtype, Sourced]
    numbers: Numbers

    @field_validator("peak_tflops")
    @classmethod
    def _every_dtype(cls, peaks: dict[Dtype, Sourced]) -> dict[Dtype, Sourced]:
        missing = [d for d in DTYPES if d not in peaks]
        if missing:
            raise ValueError(f"peak_tflops lacks {', '.join(missing)}")
        return peaks

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s (OP/s for int8) for ``dtype`` ("bfloat16" or "torch.bfloat16")."""
        key = _DTYPE_BY_NAME.get(dtype.removeprefix("torch."))
        if key is None:
            raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        return self.peak_tflops[key].value * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.numbers.memory_gb.value * 1e9

    @property
    def memory_bandwidth(self) -> float:
        return self.numbers.memory_gbps.value * 1e9

    @property
    def host_link(self) -> float:
        return self.numbers.host_link_gbps.value * 1e9

    @property
    def power_w(self) -> float:
        return self.numbers.power_w.value

    @property
    def price_usd(self) -> float:
        return self.numbers.price_usd.value

    @property
    def cloud_usd_per_hour(self) -> float:
        return self.numbers.cloud_usd_per_hour.value

    @property
    def matmul_efficiency(self) -> float:
        return self.numbers.matmul_efficiency.value

    @property
    def memory_efficiency(self) -> float:
        return self.numbers.memory_efficiency.value

    @property
    def launch_overhead(self) -> float:
        return self.numbers.launch_overhead_us.value * 1e-6


def load_device(path: Path) -> DeviceSpec:
    """One catalogue file; a file that is not valid TOML or not a valid entry raises ``ValueError`` naming it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: cannot read hardware entry: {e}") from None
    try:
        return DeviceSpec.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid hardware entry: {e}") from None


def load_catalogue(folder: Path | None = None) -> dict[str, DeviceSpec]:
    """Every ``*.toml`` in ``folder`` (default: the shipped catalogue), keyed by file stem (``"rtx3080"``)."""
    root = CATALOGUE_DIR if folder is None else folder
    if not root.is_dir():
        raise ValueError(f"{root}: no hardware catalogue folder")
    return {path.stem: load_device(path) for path in sorted(root.glob("*.toml"))}


def lookup(device_name: str, catalogue: Mapping[str, DeviceSpec]) -> DeviceSpec | None:
    """The entry with the longest ``match`` substring in ``device_name`` (case-insensitive), or None.

    Names beginning with "cpu" (e.g. "cpu: AMD EPYC") only match CPU entries.
    """
    name = device_name.lower()
    cpu_only = name.startswith("cpu")
    best: DeviceSpec | None = None
    best_len = 0
    for spec in catalogue.values():
        if cpu_only and spec.kind != "cpu":
            continue
        for pattern in spec.match:
            if pattern.lower() in name and len(pattern) > best_len:
                best, best_len = spec, len(pattern)
    return best
