"""What an averaging round puts on the wire, part by part: float32, 8-bit blocks, or only the nonzero values of a
sparse part (their positions and 8-bit values).

hivemind's all-reduce sends each part through a compression of its registry, chosen by an enum its protocol fixes;
its 8-bit types go through a torch API deprecated in our torch (a warning on every process's stderr) or take about
two seconds a million values on a CPU, and it has no sparse type. So the runner of ``swarm/training/robust.py``
sends every part through this codec instead, inside hivemind's messages (``runtime_pb2.Tensor``: the format in
``dtype``, the part's shape in ``size``), and a reducer returns the reduced values themselves, encoded once: every
groupmate, the reducer included, ends the round with the same decoded values.

Everything read is bounded: the shape must be the part's, the buffer exactly as long as its format says, positions
strictly increasing inside the part, scales finite (``CodecError`` otherwise: the sender is dropped from the round).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
from typing import Literal

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

Format = Literal["none", "int8", "topk"]
FORMATS: tuple[Format, ...] = ("none", "int8", "topk")
BLOCK = 256  # values sharing one 8-bit scale
_WIRE = {"none": "float32", "int8": "swarm-int8", "topk": "swarm-sparse8"}


class CodecError(ValueError):
    """A part that does not decode: the sender broke the format."""


def _quantize(values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per block of ``BLOCK`` values: a float32 scale (the block's largest magnitude / 127) and int8 codes."""
    flat = values.detach().float().reshape(-1)
    blocks = math.ceil(flat.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, BLOCK)
    scales = rows.abs().amax(dim=1) / 127.0
    codes = torch.round(rows / scales.clamp_min(1e-30).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return scales.numpy(), codes.reshape(-1)[: flat.numel()].numpy()


def _dequantize(scales: np.ndarray, codes: np.ndarray) -> torch.Tensor:
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise CodecError("a scale is not finite or negative")
    n = codes.size
    repeated = np.repeat(scales, BLOCK)[:n]
    return torch.from_numpy(codes.astype(np.float32) * repeated)


def encode(part: torch.Tensor, fmt: Format) -> runtime_pb2.Tensor:
    flat = part.detach().float().reshape(-1).cpu()
    if fmt == "none":
        buffer = flat.numpy().tobytes()
    elif fmt == "int8":
        scales, codes = _quantize(flat)
        buffer = scales.tobytes() + codes.tobytes()
    else:
        positions = torch.nonzero(flat, as_tuple=True)[0]
        scales, codes = _quantize(flat[positions])
        count = np.array([positions.numel()], dtype=np.uint32)
        buffer = count.tobytes() + positions.to(torch.int32).numpy().astype(np.uint32).tobytes()
        buffer += scales.tobytes() + codes.tobytes()
    return runtime_pb2.Tensor(buffer=buffer, size=list(part.shape), dtype=_WIRE[fmt], requires_grad=False)


def decode(message: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
    """The part ``message`` holds, which must have ``shape`` (the part this peer expects)."""
    if tuple(message.size) != tuple(shape):
        raise CodecError(f"a part of shape {tuple(message.size)} where {tuple(shape)} was expected")
    n, buffer = math.prod(shape), message.buffer
    if message.dtype == _WIRE["none"]:
        if len(buffer) != 4 * n:
            raise CodecError("a float32 part of the wrong length")
        # a part with NaN or infinity decodes as it is: the robust reduction leaves it out, the owner's check
        # refuses such a result
        return torch.from_numpy(np.frombuffer(buffer, dtype=np.float32).copy()).reshape(shape)
    if message.dtype == _WIRE["int8"]:
        blocks = math.ceil(n / BLOCK)
        if len(buffer) != 4 * blocks + n:
            raise CodecError("an 8-bit part of the wrong length")
        scales = np.frombuffer(buffer, dtype=np.float32, count=blocks)
        codes = np.frombuffer(buffer, dtype=np.int8, offset=4 * blocks, count=n)
        return _dequantize(scales, codes).reshape(shape)
    if message.dtype == _WIRE["topk"]:
        if len(buffer) < 4:
            raise CodecError("a sparse part without its count")
        count = int(np.frombuffer(buffer, dtype=np.uint32, count=1)[0])
        blocks = math.ceil(count / BLOCK)
        if count > n or len(buffer) != 4 + 4 * count + 4 * blocks + count:
            raise CodecError("a sparse part of the wrong length")
        positions = np.frombuffer(buffer, dtype=np.uint32, offset=4, count=count).astype(np.int64)
        if count and (positions[-1] >= n or (count > 1 and (np.diff(positions) <= 0).any())):
            raise CodecError("sparse positions out of the part or out of order")
        scales = np.frombuffer(buffer, dtype=np.float32, offset=4 + 4 * count, count=blocks)
        codes = np.frombuffer(buffer, dtype=np.int8, offset=4 + 4 * count + 4 * blocks, count=count)
        values = torch.zeros(n)
        values[torch.from_numpy(positions)] = _dequantize(scales, codes)
        return values.reshape(shape)
    raise CodecError(f"an unknown part format {message.dtype[:40]!r}")


def encoded_bytes(numel: int, nonzeros: int, fmt: Format) -> int:
    """The bytes ``encode`` gives a part of ``numel`` values with ``nonzeros`` nonzero ones (buffers only)."""
    if fmt == "none":
        return 4 * numel
    if fmt == "int8":
        return 4 * math.ceil(numel / BLOCK) + numel
    return 4 + 5 * nonzeros + 4 * math.ceil(nonzeros / BLOCK)


class Codec(CompressionBase):  # type: ignore[misc]  # hivemind ships no type information
    """The codec as a hivemind compression (what its part container calls to send this peer's parts), counting the
    bytes this peer sends in a counter shared with the process that made it (``sent``)."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, fmt: Format, density: float = 1.0) -> None:
        self.fmt, self.density = fmt, density
        self._sent = mp.Value(ctypes.c_longlong, 0, lock=True)  # made before hivemind forks the averager's process

    @property
    def sent(self) -> int:
        """Bytes of parts and replies this peer has sent to groupmates."""
        return int(self._sent.value)

    def count(self, message: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
        with self._sent.get_lock():
            self._sent.value += message.ByteSize()
        return message

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return self.count(encode(tensor, self.fmt))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return decode(serialized_tensor, torch.Size(serialized_tensor.size))

    def extract_as(self, message: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
        """A groupmate's part, which must be of ``shape``."""
        return decode(message, shape)

    def roundtrip(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` as a groupmate decodes it (what a reducer keeps of its own result)."""
        if self.fmt == "none":
            return part
        return decode(encode(part, self.fmt), part.shape).to(part.dtype)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        if self.fmt == "none":
            return 1.0
        if self.fmt == "int8":
            return 0.26
        return max(1.3 * self.density, 1e-3)
