"""The one place where tensors and metadata become bytes and back.

A message is (metadata dict, named tensors). It travels as one or more hivemind ``ExpertRequest`` protobuf frames:
the first frame carries the msgpack metadata (with the tensor names), and tensor bytes are cut into parts of at most
``FRAME_BYTES`` so that no frame reaches p2pd's 4 MiB limit. A receiver knows when a message is complete from the
names list and each tensor's part count, so one stream can carry many messages back to back (inference steps).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, MutableSequence
from typing import TYPE_CHECKING

import msgpack
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.errors import BadInputError

FRAME_BYTES = 2 * 1024 * 1024
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")
}

if TYPE_CHECKING:  # the shapes of hivemind's generated protobuf messages, which ship without type information

    class TensorPart:
        buffer: bytes
        size: MutableSequence[int]
        dtype: str
        compression: int
        chunks: int

        def __init__(self, *, buffer: bytes = b"", size: list[int] | None = None, dtype: str = "") -> None: ...

    class Frame:
        uid: str
        metadata: bytes
        tensors: MutableSequence[TensorPart]

        def __init__(self, *, uid: str = "", metadata: bytes = b"") -> None: ...
        def ByteSize(self) -> int: ...
        def SerializeToString(self) -> bytes: ...
        @classmethod
        def FromString(cls, data: bytes) -> Frame: ...

else:
    TensorPart = runtime_pb2.Tensor
    Frame = runtime_pb2.ExpertRequest

Meta = dict[str, object]  # decoded metadata: hostile until a pydantic model has validated it
Message = tuple[Meta, dict[str, torch.Tensor]]


def encode(meta: Meta, tensors: dict[str, torch.Tensor] | None = None) -> list[Frame]:
    tensors = tensors or {}
    header = dict(meta, _tensors=list(tensors))
    frames = [Frame(metadata=msgpack.packb(header, use_bin_type=True))]
    size = 0
    for tensor in tensors.values():
        serialized = _serialize(tensor)
        for part in split_for_streaming(serialized, FRAME_BYTES):
            if size + len(part.buffer) > FRAME_BYTES and len(frames[-1].tensors) > 0:
                frames.append(Frame())
                size = 0
            frames[-1].tensors.append(part)
            size += len(part.buffer)
    return frames


def encoded_size(frames: Iterable[Frame]) -> int:
    return sum(f.ByteSize() for f in frames)


class Decoder:
    """Feed frames in order; ``feed`` returns a complete message or None while parts are still missing."""

    def __init__(self, max_bytes: int = 1 << 62) -> None:
        self.max_bytes = max_bytes
        self.total_bytes = 0  # every frame fed so far (traffic accounting)
        self._reset()

    def _reset(self) -> None:
        self._meta: Meta | None = None
        self._names: list[str] = []
        self._done: list[TensorPart] = []
        self._parts: list[TensorPart] = []
        self._bytes = 0

    @property
    def in_progress(self) -> bool:
        """Part of a message has arrived, not all of it."""
        return self._meta is not None

    def feed(self, frame: Frame) -> Message | None:
        size = frame.ByteSize()
        self._bytes += size
        self.total_bytes += size
        if self._bytes > self.max_bytes:
            raise BadInputError(f"message larger than the limit of {self.max_bytes} bytes")
        if self._meta is None:
            self._meta, self._names = _unpack_meta(frame.metadata)
        for part in frame.tensors:
            self._parts.append(part)
            if len(self._parts) >= max(self._parts[0].chunks, 1):
                self._done.append(_combine(self._parts))
                self._parts = []
        if len(self._done) > len(self._names):
            raise BadInputError("message holds more tensors than its metadata names")
        if len(self._done) < len(self._names):
            return None
        message = self._meta, {name: _to_tensor(t) for name, t in zip(self._names, self._done, strict=True)}
        self._reset()
        return message


def decode(frames: Iterable[Frame], max_bytes: int = 1 << 62) -> Message:
    decoder = Decoder(max_bytes)
    for frame in frames:
        message = decoder.feed(frame)
        if message is not None:
            return message
    raise BadInputError("message ended before all its tensors arrived")


async def read_message(frames: AsyncIterator[Frame], decoder: Decoder) -> Message | None:
    """The next complete message of a stream, or None when the stream ends cleanly between messages."""
    async for frame in frames:
        message = decoder.feed(frame)
        if message is not None:
            return message
    if decoder.in_progress:
        raise BadInputError("stream ended in the middle of a message")
    return None


def _unpack_meta(raw: bytes) -> tuple[Meta, list[str]]:
    try:
        meta: object = msgpack.unpackb(raw, raw=False)
    except Exception as e:
        raise BadInputError(f"malformed metadata: {e}") from None
    names = meta.pop("_tensors", None) if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInputError("malformed metadata: expected a map with a tensor name list")
    if not all(isinstance(k, str) for k in meta):
        raise BadInputError("malformed metadata: keys must be strings")
    return meta, names


def _combine(parts: list[TensorPart]) -> TensorPart:
    combined: TensorPart = combine_from_streaming(parts)
    return combined


def _serialize(tensor: torch.Tensor) -> TensorPart:
    """Raw little-endian bytes of a contiguous tensor (hivemind's Tensor message, no compression). Our own codec:
    hivemind's generic one costs ~0.5 ms per small tensor, which is most of a decode step's overhead."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise BadInputError(f"tensor dtype {name!r} cannot be sent")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return TensorPart(buffer=flat.view(torch.uint8).numpy().tobytes(), size=list(tensor.shape), dtype=name)


def _to_tensor(serialized: TensorPart) -> torch.Tensor:
    dtype = DTYPES.get(serialized.dtype)
    if dtype is None or serialized.compression != runtime_pb2.CompressionType.NONE:
        raise BadInputError(f"tensor dtype {serialized.dtype!r} / compression {serialized.compression} is not accepted")
    shape = tuple(serialized.size)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != len(serialized.buffer):
        raise BadInputError(f"malformed tensor: {len(serialized.buffer)} bytes for shape {list(shape)} {dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(serialized.buffer), dtype=dtype).view(shape)
