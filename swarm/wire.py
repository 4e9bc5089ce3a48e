"""The one place where tensors and metadata become bytes and back.

A message is (metadata dict, named tensors). It travels as one or more hivemind ``ExpertRequest`` protobuf frames:
the first frame carries the msgpack metadata (with the tensor names), and tensor bytes are cut into parts of at most
``FRAME_BYTES`` so that no frame reaches p2pd's 4 MiB limit. A receiver knows when a message is complete from the
names list and each tensor's part count, so one stream can carry many messages back to back (inference steps).
Activations (``swarm.codecs.ACTIVATIONS``) may travel compressed: each tensor part names its compression, and
decoding restores the sender's dtype whatever the codec, after ``swarm.codecs`` has checked every field.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable, MutableSequence
from typing import TYPE_CHECKING

import msgpack
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm import codecs
from swarm.codecs import Codec, TensorPart
from swarm.errors import BadInputError, BusyError, MessageTooLargeError

FRAME_BYTES = 2 * 1024 * 1024
MAX_METADATA = 256 * 1024  # a message's msgpack metadata: requests and replies hold a few hundred bytes
MAX_TENSORS = 1 << 16  # tensors named in one message (a stage's whole state with its Adam moments fits)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")
}

if TYPE_CHECKING:  # the shapes of hivemind's generated protobuf messages, which ship without type information

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
    Frame = runtime_pb2.ExpertRequest

_NAMES = {dtype: name for name, dtype in DTYPES.items()}
Meta = dict[str, object]  # decoded metadata: hostile until a pydantic model has validated it
Message = tuple[Meta, dict[str, torch.Tensor]]


def encode(meta: Meta, tensors: dict[str, torch.Tensor] | None = None, codec: Codec | None = None) -> list[Frame]:
    """``codec``: how the float tensors named in ``codecs.ACTIVATIONS`` travel (None or ``none``: exact); every other
    tensor always travels exact. A receiver needs no setting: each tensor part says its compression."""
    tensors = tensors or {}
    header = dict(meta, _tensors=list(tensors))
    frames = [Frame(metadata=msgpack.packb(header, use_bin_type=True))]
    size = 0
    for name, tensor in tensors.items():
        serialized = _serialize(tensor, codec if codec is not None and name in codecs.ACTIVATIONS else None)
        if len(serialized.buffer) <= FRAME_BYTES:  # one part (a decode step's): as split_for_streaming makes it
            serialized.chunks = 1 if serialized.buffer else 0
            parts: Iterable[TensorPart] = (serialized,)
        else:
            parts = split_for_streaming(serialized, FRAME_BYTES)
        for part in parts:
            if size + len(part.buffer) > FRAME_BYTES and len(frames[-1].tensors) > 0:
                frames.append(Frame())
                size = 0
            frames[-1].tensors.append(part)
            size += len(part.buffer)
    return frames


def as_received(tensor: torch.Tensor, codec: Codec | None) -> torch.Tensor:
    """``tensor`` as a receiver decodes it when it travels in ``codec`` (itself when exact): what a commitment to a
    sent activation must digest."""
    if codec is None or codec == Codec.none or not tensor.is_floating_point():
        return tensor
    return _to_tensor(_serialize(tensor, codec))


def encoded_size(frames: Iterable[Frame]) -> int:
    return sum(f.ByteSize() for f in frames)


class ByteBudget:
    """Bytes a server holds for others (requests arriving, queued or being answered, replies being written, pushes
    waiting), per caller and all callers together: what keeps its memory bounded however many connections, from
    however many identities, send or stop reading at once. A claim over either limit is refused as ``busy``: the
    newest claimant is turned away, and what is already held stays."""

    def __init__(self, limit: int, per_caller: int | None = None) -> None:
        self.limit = limit
        self.per_caller = limit if per_caller is None else per_caller
        self.used = 0
        self.by_caller: dict[str, int] = {}
        self.refused = 0  # claims turned away (status, tests)

    def take(self, nbytes: int, caller: str = "anonymous") -> None:
        held = self.by_caller.get(caller, 0)
        if held + nbytes > self.per_caller:
            self.refused += 1
            raise BusyError(
                f"this caller holds {held >> 20} MiB of this server's memory, its limit of {self.per_caller >> 20} "
                "MiB (--max-caller-held-mb); wait for its requests to finish"
            )
        if self.used + nbytes > self.limit:
            self.refused += 1
            raise BusyError(f"this server holds {self.used >> 20} MiB for its callers, its limit; try again elsewhere")
        self.used += nbytes
        self.by_caller[caller] = held + nbytes

    def hold(self, nbytes: int, caller: str = "anonymous") -> None:
        """Count bytes that exist already and cannot be refused (a reply being written): they make the next claim of
        this caller, or of anyone once the total is reached, fail instead."""
        self.used += nbytes
        self.by_caller[caller] = self.by_caller.get(caller, 0) + nbytes

    def give(self, nbytes: int, caller: str = "anonymous") -> None:
        self.used -= nbytes
        left = self.by_caller.get(caller, 0) - nbytes
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)  # a caller holding nothing costs no memory


class SessionRoom:
    """Room set aside in a ``ByteBudget`` for one established session (taken when it opens, so a full server refuses
    the newcomer instead): its messages count here first, so callers filling the budget later never starve it. What
    does not fit the room is claimed from the budget as any request's bytes are."""

    def __init__(self, budget: ByteBudget, caller: str, room: int) -> None:
        budget.take(room, caller)
        self.budget, self.caller, self.room = budget, caller, room
        self.used = 0  # of the room
        self.over = 0  # claimed from the budget beyond the room

    def take(self, nbytes: int, caller: str = "anonymous") -> None:
        beyond = max(self.used + nbytes - self.room, 0)
        if beyond:
            self.budget.take(beyond, self.caller)
            self.over += beyond
        self.used += nbytes - beyond

    def hold(self, nbytes: int, caller: str = "anonymous") -> None:
        beyond = max(self.used + nbytes - self.room, 0)
        self.budget.hold(beyond, self.caller)
        self.over += beyond
        self.used += nbytes - beyond

    def give(self, nbytes: int, caller: str = "anonymous") -> None:
        back = min(nbytes, self.over)
        if back:
            self.budget.give(back, self.caller)
            self.over -= back
        self.used -= nbytes - back

    def close(self) -> None:
        """Give the room (and anything still claimed beyond it) back: the session ended."""
        self.budget.give(self.room + self.over, self.caller)
        self.room = self.used = self.over = 0


class Decoder:
    """Feed frames in order; ``feed`` returns a complete message or None while parts are still missing.

    With a ``budget``, the bytes of the messages it decoded stay counted there (as ``caller``'s) until ``release``
    (the caller is done with them) or the decoder is dropped by ``release`` at the end of its stream."""

    def __init__(
        self, max_bytes: int = 1 << 62, budget: ByteBudget | SessionRoom | None = None, caller: str = "anonymous"
    ) -> None:
        self.max_bytes = max_bytes
        self.total_bytes = 0  # every frame fed so far (traffic accounting)
        self.budget = budget
        self.caller = caller
        self.held = 0  # bytes counted in ``budget`` by this decoder
        self._reset()

    def release(self) -> None:
        """Give back to the budget every byte this decoder counted (its messages are answered, or it is closed), and
        drop any partial message: its parts are freed now, not when the stream's last reference goes."""
        if self.budget is not None and self.held:
            self.budget.give(self.held, self.caller)
        self.held = 0
        if self.in_progress:
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
            raise MessageTooLargeError(f"message larger than the limit of {self.max_bytes} bytes")
        if self.budget is not None:
            self.budget.take(size, self.caller)
            self.held += size
        if self._meta is None:
            self._meta, self._names = _unpack_meta(frame.metadata)
        for part in frame.tensors:
            self._parts.append(part)
            if len(self._parts) >= max(self._parts[0].chunks, 1):
                self._done.append(self._parts[0] if len(self._parts) == 1 else _combine(self._parts))
                self._parts = []
                if len(self._done) > len(self._names):  # checked per part: a flood of empty parts stops here
                    raise BadInputError("message holds more tensors than its metadata names")
            elif len(part.buffer) != FRAME_BYTES:  # every part but a tensor's last is full (``encode``)
                raise BadInputError(f"malformed tensor: a part of {len(part.buffer)} bytes before its last part")
        if len(self._done) < len(self._names):
            return None
        decoded = _decoded_bytes(self._done)
        if self.budget is not None and self._bytes < decoded <= self.max_bytes:  # (over the limit: refused below)
            # what decoding will allocate beyond the wire bytes, counted before it is: compressed activations decode
            # to about 4x their wire size
            self.budget.take(decoded - self._bytes, self.caller)
            self.held += decoded - self._bytes
        message = self._meta, _to_tensors(self._names, self._done, self.max_bytes)
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
    if len(raw) > MAX_METADATA:  # msgpack builds ~30x its input in objects: refused before it is read
        raise BadInputError(f"malformed metadata: {len(raw)} bytes exceed the limit of {MAX_METADATA}")
    try:
        meta: object = msgpack.unpackb(raw, raw=False)
    except Exception as e:
        raise BadInputError(f"malformed metadata: {e}") from None
    names = meta.pop("_tensors", None) if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInputError("malformed metadata: expected a map with a tensor name list")
    if len(names) > MAX_TENSORS:
        raise BadInputError(f"malformed metadata: {len(names)} tensors exceed the limit of {MAX_TENSORS}")
    if not all(isinstance(k, str) for k in meta):
        raise BadInputError("malformed metadata: keys must be strings")
    return meta, names


def _combine(parts: list[TensorPart]) -> TensorPart:
    combined: TensorPart = combine_from_streaming(parts)
    return combined


def _serialize(tensor: torch.Tensor, codec: Codec | None = None) -> TensorPart:
    """Raw little-endian bytes of a contiguous tensor (hivemind's Tensor message, no compression), or ``codec``'s
    form of a float tensor. Our own serializer: hivemind's generic one costs ~0.5 ms per small tensor, which is most
    of a decode step's overhead."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise BadInputError(f"tensor dtype {str(tensor.dtype).removeprefix('torch.')!r} cannot be sent")
    if codec is not None and codec != Codec.none and tensor.is_floating_point():
        part = codecs.compress(tensor, codec, name)
        if part is not None:
            return part
    return TensorPart(buffer=raw_bytes(tensor), size=list(tensor.shape), dtype=name)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as little-endian bytes, in its dtype (what travels, and what a commitment digests)."""
    data = tensor.detach().cpu().contiguous()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: its bytes through a byte view
        return data.reshape(-1).view(torch.uint8).numpy().tobytes()
    return data.numpy().tobytes()


def _decoded_bytes(parts: list[TensorPart]) -> int:
    """The bytes ``parts`` will take decoded, read off their headers (a malformed header counts 0: decoding refuses
    it before allocating)."""
    total = 0
    for part in parts:
        shape = tuple(part.size)
        dtype = DTYPES.get(part.dtype)
        if dtype is None or len(shape) > 8 or any(d < 0 for d in shape):
            continue
        total += math.prod(shape) * dtype.itemsize
    return total


def _to_tensors(names: list[str], parts: list[TensorPart], max_bytes: int) -> dict[str, torch.Tensor]:
    """A message's tensors, decoded to at most ``max_bytes`` together (its limit on the wire): a compressed tensor
    may not claim more room than the message could hold uncompressed."""
    tensors: dict[str, torch.Tensor] = {}
    for name, part in zip(names, parts, strict=True):
        tensor = tensors[name] = _to_tensor(part, max_bytes)
        max_bytes -= tensor.numel() * tensor.element_size()
    return tensors


def _to_tensor(serialized: TensorPart, max_bytes: int = 1 << 62) -> torch.Tensor:
    if serialized.compression != runtime_pb2.CompressionType.NONE:
        return codecs.decompress(serialized, max_bytes)
    dtype = DTYPES.get(serialized.dtype)
    if dtype is None:
        raise BadInputError(f"tensor dtype {serialized.dtype!r} is not accepted")
    shape = tuple(serialized.size)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != len(serialized.buffer):
        raise BadInputError(f"malformed tensor: {len(serialized.buffer)} bytes for shape {list(shape)} {dtype}")
    try:
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(serialized.buffer), dtype=dtype).view(shape)
    except RuntimeError as e:  # torch refuses some shapes its size check cannot see (a zero-size dim beside huge ones)
        raise BadInputError(f"malformed tensor: shape {list(shape)}: {e}") from None
