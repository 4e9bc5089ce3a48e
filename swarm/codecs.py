"""Activation codecs: how hidden states and their gradients shrink on the wire, and which one a link deserves.

A codec turns one float tensor into a hivemind ``runtime_pb2.Tensor`` part whose ``compression`` names the format
and whose ``dtype`` is the tensor's own dtype (what the receiver gets back), and back. Formats:

* ``float16`` (hivemind's ``FLOAT16`` layout: raw float16, values clamped to its range) and ``bfloat16`` (raw
  bfloat16; a compression id of ours, ``16``: hivemind has none for it) halve a float32 tensor;
* ``uint8`` and ``quantile8``: hivemind's ``UNIFORM_8BIT`` / ``QUANTILE_8BIT`` quantizers (a per-tensor codebook of
  256 float32 values, one byte per value): ``[int64 256][256 x float32 codebook][numel x uint8]``;
* ``block8``: ours (id ``17``; hivemind's ``BLOCKWISE_8BIT`` needs bitsandbytes): per block of ``BLOCK`` values,
  its largest-magnitude value kept exact (float32 value, uint8 index) and the rest as signed 8-bit codes of
  ``sqrt(|x| / scale)`` (square-root companding: finer steps near zero, where most values are), with the block's
  remaining absmax as float32 ``scale``: ``[uint32 block][nblocks x f32 scale][nblocks x f32 outlier]
  [nblocks x uint8 outlier index][numel x int8]``. Transformers' residual streams hold a few huge channels (SmolLM2:
  ~100x the typical value, one attention-sink token ~10^4): per-tensor codebooks (``uint8``, ``quantile8``) spend
  their whole range on them and lose the rest; blocks with the outlier taken out do not (scripts/eval_compression.py
  measures all of them).

Every byte of a part is hostile: ``decompress`` checks the exact length for the claimed shape, the codebook size,
the block size and count, that scales and codebooks are finite, and that the output fits the caller's limit (the
message's), before it allocates anything; it then decodes by itself, a chunk at a time, rather than trusting
hivemind's decoders with unchecked input. So a part costs its output and a constant, never more than its limit.
Failures are ``BadInputError``.
"""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Callable, MutableSequence
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch
from hivemind.compression import Quantile8BitQuantization, Uniform8BitQuantization
from hivemind.proto import runtime_pb2

from swarm.errors import BadInputError

if TYPE_CHECKING:  # the shape of hivemind's generated protobuf message, which ships without type information

    class TensorPart:
        buffer: bytes
        size: MutableSequence[int]
        dtype: str
        compression: int
        chunks: int

        def __init__(self, *, buffer: bytes = b"", size: list[int] | None = None, dtype: str = "") -> None: ...

else:
    TensorPart = runtime_pb2.Tensor


class Codec(StrEnum):
    none = "none"
    float16 = "float16"
    bfloat16 = "bfloat16"
    uint8 = "uint8"  # hivemind's uniform 8-bit (a 6-sigma range: clips outlier channels)
    quantile8 = "quantile8"  # hivemind's quantile 8-bit (per-tensor codebook of 256 quantile means)
    block8 = "block8"  # ours: per-block absmax int8


# Only these tensors are ever compressed: activations whose error the model tolerates. Masks, positions, adapter
# weights and their gradients, training states and probe payloads always travel exact.
ACTIVATIONS = frozenset({"hidden", "grad_output", "grad_input"})

EIGHT_BIT = Codec.block8  # the 8-bit codec "auto" picks: the most accurate of the three (scripts/eval_compression.py)
BLOCK = 128  # values per block8 block: 9 bytes of scale and outlier each (3.74x smaller than float32)
MIN_BLOCK, MAX_BLOCK = 16, 256  # block sizes a receiver accepts (powers of two; an outlier index is one byte)

WIRE_IDS: dict[Codec, int] = {
    Codec.float16: runtime_pb2.CompressionType.FLOAT16,
    Codec.bfloat16: 16,  # beyond hivemind's enum (protobuf keeps unknown enum values), read only by swarm peers
    Codec.uint8: runtime_pb2.CompressionType.UNIFORM_8BIT,
    Codec.quantile8: runtime_pb2.CompressionType.QUANTILE_8BIT,
    Codec.block8: 17,
}
CODECS_BY_ID = {wire_id: codec for codec, wire_id in WIRE_IDS.items()}
FLOATS: dict[str, torch.dtype] = {n: getattr(torch, n) for n in ("float32", "float16", "bfloat16", "float64")}
_CODEBOOK = 256  # hivemind's 8-bit quantizers always send 256 codebook entries
_FP16_MAX = torch.finfo(torch.float16).max

# ---- choosing ------------------------------------------------------------------------------------------------------
# Costs measured on one CPU core (float32 input): a float16/bfloat16 cast runs at >2 GB/s, block8 at ~0.3 GB/s
# encode + decode (quantile8 ~0.1 GB/s). Compressing pays off when the transfer time it saves beats that CPU time:
# * a message whose float32 transfer takes under MIN_SAVING_S is sent as is: at most ~1.5 ms to save, the order of
#   one message's fixed costs (framing, a syscall, an event-loop turn), and results stay bit-exact on fast links;
# * float16 saves half the transfer: worth its cast below ~8 Gbps, so any link slow enough to pass the first rule;
# * 8-bit saves another quarter: nbytes/4 * 8/link against nbytes/0.3e9 of CPU, i.e. worth it below ~600 Mbps;
#   SLOW_MBPS keeps it to links clearly below that, where the link and not the CPU is the bottleneck (and where
#   FusionLLM's AdaTopK compresses too: only the slow links).
MIN_SAVING_S = 0.002
SLOW_MBPS = 200.0


def transfer_seconds(nbytes: int, mbps: float) -> float:
    return nbytes * 8 / (mbps * 1e6)


def choose_codec(
    nbytes: int,
    mbps: float | None,
    *,
    forced: Codec | None = None,
    eight_bit: Codec = EIGHT_BIT,
    min_saving_s: float = MIN_SAVING_S,
    slow_mbps: float = SLOW_MBPS,
) -> Codec:
    """The codec for ``nbytes`` of float32 activations over a link of ``mbps`` megabits per second (None: unknown,
    sent as is); ``forced`` wins."""
    if forced is not None:
        return forced
    if mbps is None or not mbps > 0 or transfer_seconds(nbytes, mbps) < min_saving_s:
        return Codec.none
    return eight_bit if mbps < slow_mbps else Codec.float16


def parse_codec(name: str) -> Codec | None:
    """A setting's value: ``auto`` (None: chosen per link) or a codec name to force."""
    if name == "auto":
        return None
    try:
        return Codec(name)
    except ValueError:
        raise BadInputError(f"unknown codec {name!r}: auto or one of {', '.join(Codec)}") from None


# ---- encoding ------------------------------------------------------------------------------------------------------
def compress(tensor: torch.Tensor, codec: Codec, dtype_name: str) -> TensorPart | None:
    """``tensor`` (a float tensor of dtype ``dtype_name``) in ``codec``, or None where it should travel as is: no
    codec, a format that would not be smaller, or non-finite values (an honest NaN/inf must arrive as one, not as a
    broken scale the receiver refuses)."""
    if codec == Codec.none or tensor.numel() == 0:
        return None
    flat = tensor.detach().cpu().reshape(-1)
    if codec in (Codec.float16, Codec.bfloat16):
        if tensor.dtype.itemsize <= 2:
            return None
        if codec == Codec.float16:  # like hivemind's Float16Compression: out-of-range values clamp, NaN stays NaN
            flat = flat.float().clamp(-_FP16_MAX, _FP16_MAX)
        target = torch.float16 if codec == Codec.float16 else torch.bfloat16
        buffer = flat.to(target).contiguous().view(torch.uint8).numpy().tobytes()
    else:
        x = flat.float()
        if not bool(torch.isfinite(x).all()):
            return None
        packed = _block8(x) if codec == Codec.block8 else _codebook8(x, codec)
        if packed is None or len(packed) >= flat.numel() * tensor.dtype.itemsize:
            return None
        buffer = packed
    part = _part(buffer, list(tensor.shape), dtype_name)
    part.compression = WIRE_IDS[codec]
    return part


def _part(buffer: bytes, size: list[int], dtype: str) -> TensorPart:
    part: TensorPart = runtime_pb2.Tensor(buffer=buffer, size=size, dtype=dtype)
    return part


def _codebook8(x: torch.Tensor, codec: Codec) -> bytes | None:
    quantizer = Uniform8BitQuantization() if codec == Codec.uint8 else Quantile8BitQuantization()
    try:
        with warnings.catch_warnings():  # torch deprecates the quantize_per_tensor hivemind's uniform codec calls
            warnings.simplefilter("ignore", UserWarning)
            indices, codebook = quantizer.quantize(x)
    except (RuntimeError, ValueError):  # e.g. a constant tensor: zero scale for the uniform quantizer
        return None
    if len(codebook) != _CODEBOOK:
        return None
    return b"".join((np.int64(_CODEBOOK).tobytes(), codebook.astype("<f4").tobytes(), indices.tobytes()))


def _block8(x: torch.Tensor, block: int = BLOCK) -> bytes:
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(x, (0, blocks * block - n)).view(blocks, block)
    magnitude = padded.abs()
    index = magnitude.argmax(dim=1, keepdim=True)
    outliers = padded.gather(1, index)
    magnitude.scatter_(1, index, 0.0)
    scales = magnitude.amax(dim=1, keepdim=True)
    # in place, one buffer: the code is round(127 * sqrt(|x| / scale)) with x's sign
    magnitude.div_(scales.clamp_min(torch.finfo(torch.float32).tiny)).sqrt_().mul_(127).round_().copysign_(padded)
    codes = magnitude.to(torch.int8).reshape(-1)[:n]
    return b"".join(
        (
            struct.pack("<I", block),
            scales.numpy().astype("<f4").tobytes(),
            outliers.numpy().astype("<f4").tobytes(),
            index.to(torch.uint8).numpy().tobytes(),
            codes.numpy().tobytes(),
        )
    )


# ---- decoding ------------------------------------------------------------------------------------------------------
CHUNK = 1 << 16  # values decoded at a time (whole blocks: a multiple of MAX_BLOCK): what a codec's working buffers,
# beyond the output, are a few times


def decompress(part: TensorPart, max_bytes: int = 1 << 62) -> torch.Tensor:
    """The tensor a compressed part holds, in the dtype it names; any inconsistency is ``BadInputError``.

    Everything is checked on the header and the buffer's length before anything is allocated: the exact length the
    codec implies for the claimed shape, the codebook or blocks, and that the output (numel x the dtype's size)
    stays within ``max_bytes`` (the caller's limit: what its message may hold). Then the output is the one
    allocation the size of the message: it is decoded ``CHUNK`` values at a time, from views of the buffer (no copy
    of it, no upcast of the whole). The output lives in a numpy buffer, which ``tracemalloc`` sees (tests measure
    what decoding allocates)."""
    codec = CODECS_BY_ID.get(part.compression)
    dtype = FLOATS.get(part.dtype)
    if codec is None or dtype is None:
        raise BadInputError(f"tensor compression {part.compression} of dtype {part.dtype!r} is not accepted")
    shape = tuple(part.size)
    if len(shape) > 8 or any(d < 0 for d in shape):
        raise BadInputError(f"malformed {codec} tensor: shape {list(shape)}")
    numel = math.prod(shape)
    buffer = part.buffer
    if codec in (Codec.float16, Codec.bfloat16):
        _expect_length(codec, buffer, 2 * numel, shape)
        decode = _unhalf(codec, buffer)
    elif codec == Codec.block8:
        decode = _unblock8(buffer, numel, shape)
    else:
        decode = _uncodebook8(codec, buffer, numel, shape)
    nbytes = numel * dtype.itemsize
    if nbytes > max_bytes:
        raise BadInputError(f"malformed {codec} tensor: {nbytes} bytes decoded, over the limit of {max_bytes}")
    if numel == 0:
        try:
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as e:  # a zero-size dim beside huge ones
            raise BadInputError(f"malformed {codec} tensor: shape {list(shape)}: {e}") from None
    out = torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype)
    for start in range(0, numel, CHUNK):
        stop = min(start + CHUNK, numel)
        out[start:stop].copy_(decode(start, stop))
    return out.view(shape)


Decode = Callable[[int, int], torch.Tensor]  # values [start, stop), in a float dtype


def _expect_length(codec: Codec, buffer: bytes, expected: int, shape: tuple[int, ...]) -> None:
    if len(buffer) != expected:
        raise BadInputError(f"malformed {codec} tensor: {len(buffer)} bytes for shape {list(shape)}, not {expected}")


def _floats(buffer: bytes, offset: int, count: int) -> npt.NDArray[np.float32]:
    return np.frombuffer(buffer, dtype="<f4", count=count, offset=offset).astype(np.float32)  # a copy of `count`


def _unhalf(codec: Codec, buffer: bytes) -> Decode:
    wire_dtype = torch.float16 if codec == Codec.float16 else torch.bfloat16
    with warnings.catch_warnings():  # a read-only view of the buffer: decoding only reads it
        warnings.simplefilter("ignore", UserWarning)
        halves = torch.frombuffer(buffer, dtype=wire_dtype) if buffer else torch.empty(0, dtype=wire_dtype)
    return lambda start, stop: halves[start:stop]  # converted by ``copy_`` into the output: no intermediate


def _uncodebook8(codec: Codec, buffer: bytes, numel: int, shape: tuple[int, ...]) -> Decode:
    if len(buffer) < 8:
        raise BadInputError(f"malformed {codec} tensor: {len(buffer)} bytes, no codebook size")
    (size,) = struct.unpack_from("<q", buffer)
    if size != _CODEBOOK:
        raise BadInputError(f"malformed {codec} tensor: codebook of {size} values, not {_CODEBOOK}")
    at = 8 + 4 * size
    _expect_length(codec, buffer, at + numel, shape)
    codebook = _floats(buffer, 8, size)
    if not np.isfinite(codebook).all():
        raise BadInputError(f"malformed {codec} tensor: non-finite codebook")

    def decode(start: int, stop: int) -> torch.Tensor:
        indices = np.frombuffer(buffer, dtype=np.uint8, count=stop - start, offset=at + start)
        return torch.from_numpy(codebook[indices])  # every uint8 index is in range of 256 entries

    return decode


def _unblock8(buffer: bytes, numel: int, shape: tuple[int, ...]) -> Decode:
    codec = Codec.block8
    if len(buffer) < 4:
        raise BadInputError(f"malformed {codec} tensor: {len(buffer)} bytes, no block size")
    (block,) = struct.unpack_from("<I", buffer)
    if not MIN_BLOCK <= block <= MAX_BLOCK or block & (block - 1):
        raise BadInputError(f"malformed {codec} tensor: block size {block} (powers of two {MIN_BLOCK}..{MAX_BLOCK})")
    blocks = -(-numel // block)
    _expect_length(codec, buffer, 4 + 9 * blocks + numel, shape)
    at_outliers, at_index, at_codes = 4 + 4 * blocks, 4 + 8 * blocks, 4 + 9 * blocks
    for first in range(0, blocks, CHUNK):  # checked a chunk at a time too: the checks allocate no more than decoding
        n = min(CHUNK, blocks - first)
        scales = _floats(buffer, 4 + 4 * first, n)
        if not np.isfinite(scales).all() or not np.isfinite(_floats(buffer, at_outliers + 4 * first, n)).all():
            raise BadInputError(f"malformed {codec} tensor: non-finite scales or outliers")
        if (scales < 0).any():
            raise BadInputError(f"malformed {codec} tensor: negative scales")
        if (np.frombuffer(buffer, dtype=np.uint8, count=n, offset=at_index + first) >= block).any():
            raise BadInputError(f"malformed {codec} tensor: an outlier index beyond its block of {block}")

    def decode(start: int, stop: int) -> torch.Tensor:
        first, n = start // block, -(-(stop - start) // block)  # ``start`` is a block's first value
        values = np.zeros(n * block, dtype=np.float32)
        values[: stop - start] = np.frombuffer(buffer, dtype=np.int8, count=stop - start, offset=at_codes + start)
        values = values.reshape(n, block)
        sign = np.sign(values)
        # as the float32 ops of the encoder's inverse, in this order: (|code| / 127)^2 * sign * scale
        np.abs(values, out=values)
        values /= np.float32(127)
        np.square(values, out=values)
        values *= sign
        values *= _floats(buffer, 4 + 4 * first, n)[:, None]
        index = np.frombuffer(buffer, dtype=np.uint8, count=n, offset=at_index + first)
        values[np.arange(n), index] = _floats(buffer, at_outliers + 4 * first, n)
        return torch.from_numpy(values.reshape(-1)[: stop - start])

    return decode
