"""Fuzzing the wire decoder and the direct plane's framing reader: every malformed frame or message either decodes to
a well-formed message or raises ``BadInputError`` (never another exception), never yields more than its byte limit,
and a declared size larger than the bytes present is refused without waiting or allocating.

Deterministic (``derandomize``): 1,500 examples per test in the full suite, a fifth in the fast subset;
``SWARM_FUZZ_EXAMPLES`` sets the count (``tests.helpers.examples.fuzz_examples``)."""

from __future__ import annotations

import asyncio
import random
import resource
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm import wire
from swarm.errors import BadInputError
from swarm.rpc import direct
from tests.helpers import fuzz_cases
from tests.helpers.examples import fuzz_examples

EXAMPLES = fuzz_examples(1500)
FUZZ = settings(
    derandomize=True,
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SEEDS = st.integers(min_value=0, max_value=2**64 - 1)


def _check_message(message: wire.Message, max_bytes: int) -> None:
    meta, tensors = message
    assert isinstance(meta, dict) and all(isinstance(k, str) for k in meta) and "_tensors" not in meta
    assert all(isinstance(t, torch.Tensor) and t.dtype in wire.DTYPES.values() for t in tensors.values())
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= max_bytes


def _decode_or_refuse(frames: list[wire.Frame], max_bytes: int) -> wire.Message | None:
    try:
        message = wire.decode(frames, max_bytes)
    except BadInputError:
        return None
    _check_message(message, max_bytes)
    return message


@FUZZ
@given(seed=SEEDS, max_bytes=st.sampled_from([64, 4096, 1 << 20, 1 << 62]))
def test_malformed_messages_decode_or_are_refused(seed, max_bytes):
    _decode_or_refuse(fuzz_cases.wire_junk(random.Random(seed)), max_bytes)


@FUZZ
@given(metadata=st.binary(max_size=256), parts=st.integers(0, 3))
def test_random_metadata_bytes(metadata, parts):
    frame = wire.Frame(metadata=metadata)
    for _ in range(parts):
        frame.tensors.add().buffer = b"\x00" * 4
    _decode_or_refuse([frame], 1 << 20)


_MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | st.integers(-9, 9), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(value=_MSGPACK, names=st.none() | st.lists(st.text(max_size=4) | st.integers(-9, 9), max_size=4) | _MSGPACK)
def test_msgpack_of_wrong_shapes(value, names):
    meta = dict(value) if isinstance(value, dict) else value
    if isinstance(meta, dict) and names is not None:
        meta["_tensors"] = names
    frame = wire.Frame(metadata=msgpack.packb(meta, use_bin_type=True))
    message = _decode_or_refuse([frame], 1 << 20)
    if message is not None:
        assert names == [] and isinstance(value, dict)  # only a map naming no tensors needs no tensor parts


@FUZZ
@given(
    shape=st.lists(st.sampled_from([0, 1, 2, 3, 7, 65536, 2**31, 2**32 - 1]), max_size=8),
    dtype=st.sampled_from([*wire.DTYPES, "bool", "", "float8_e4m3fn", "complex64"]),
    nbytes=st.integers(0, 256),
    compression=st.sampled_from([0, 0, 1, 5, 99]),
    chunks=st.sampled_from([0, 1, 2, 5, 2**31 - 1, -1, -(2**31)]),
    split=st.integers(0, 4),
)
def test_tensor_parts_with_wrong_sizes_dtypes_and_chunk_counts(shape, dtype, nbytes, compression, chunks, split):
    frames = [wire.Frame(metadata=msgpack.packb({"_tensors": ["t"]}))]
    first = frames[0].tensors.add()
    first.size.extend(shape)
    first.dtype, first.compression, first.chunks = dtype, compression, chunks
    first.buffer = bytes(nbytes)
    for i in range(split):  # further parts, some in frames of their own
        if i % 2:
            frames.append(wire.Frame())
        frames[-1].tensors.add().buffer = bytes(nbytes // (i + 1))
    message = _decode_or_refuse(frames, 1 << 20)
    if message is not None:
        assert list(message[1]["t"].shape) == shape


@FUZZ
@given(seed=SEEDS, cut=st.integers(0, 10_000))
def test_honest_messages_cut_or_split_oddly(seed, cut):
    """A real message, its frames cut short or fed with a part missing: refused, or (when whole) decoded exactly."""
    rng = random.Random(seed)
    tensors = {f"t{i}": torch.randn(rng.randrange(0, 3), rng.randrange(1, 5)) for i in range(rng.randrange(0, 4))}
    frames = wire.encode({"kind": "x", "n": rng.randrange(100)}, tensors)
    if cut % 3 == 0 and frames[-1].tensors:
        del frames[-1].tensors[cut % len(frames[-1].tensors)]
    elif cut % 3 == 1:
        frames[0].metadata = frames[0].metadata[: cut % (len(frames[0].metadata) + 1)]
    message = _decode_or_refuse(frames, 1 << 20)
    if cut % 3 == 2:
        assert message is not None and all(torch.equal(message[1][k], v) for k, v in tensors.items())


def test_declared_sizes_beyond_the_bytes_are_refused_cheaply():
    """Huge declared tensor sizes and lying part counts cost nothing: no tensor is allocated for them, and a stream of
    empty parts stops at the first one that cannot belong to an honest message."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    meta = msgpack.packb({"_tensors": ["t"]})
    for shape in ([2**32 - 1] * 4, [0, 2**32 - 1, 2**32 - 1], [65536, 65536]):
        frame = wire.Frame(metadata=meta)
        part = frame.tensors.add()
        part.size.extend(shape)
        part.dtype, part.buffer = "float32", b"\x00" * 16
        with pytest.raises(BadInputError, match="malformed tensor"):
            wire.decode([frame])
    flood = wire.Frame.FromString(wire.Frame(metadata=meta).SerializeToString() + b"\x12\x00" * 200_000)
    with pytest.raises(BadInputError, match="more tensors than"):  # 200k empty tensors for one name
        wire.decode([flood])
    flood.tensors[0].chunks = 2**31 - 1
    with pytest.raises(BadInputError, match="before its last part"):  # 200k empty parts of one tensor
        wire.decode([flood])
    with pytest.raises(BadInputError, match="exceed the limit"):
        wire.decode([wire.Frame(metadata=b"\xdd" + struct.pack(">I", 300_000) + b"\x80" * 300_000)])  # refused unread
    with pytest.raises(BadInputError, match="exceed the limit"):
        wire.decode([wire.Frame(metadata=msgpack.packb({"_tensors": [""] * (wire.MAX_TENSORS + 1)}))])
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024 < 100  # MiB


async def _read_all(data: bytes, eof: bool) -> list[wire.Frame]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    frames = []
    async with asyncio.timeout(5):
        while (frame := await direct.read_frame(reader)) is not None:
            frames.append(frame)
    return frames


@FUZZ
@given(seed=SEEDS)
def test_framing_reader_refuses_or_reads(seed):
    """The direct plane's reader over a stream of malformed bytes, then the decoder over what it read."""
    kind, data, complete = fuzz_cases.stream_junk(random.Random(seed))
    try:
        frames = asyncio.run(_read_all(data, eof=True))
    except BadInputError:
        return
    assert kind not in ("oversize", "short", "cut_header", "garbage")
    decoder = wire.Decoder(1 << 20)
    try:
        for frame in frames:
            message = decoder.feed(frame)
            if message is not None:
                _check_message(message, 1 << 20)
    except BadInputError:
        pass


@FUZZ
@given(size=st.integers(direct.MAX_FRAME + 1, 2**32 - 1), tail=st.binary(max_size=32))
def test_framing_reader_refuses_oversized_frames_without_waiting(size, tail):
    """No end of stream is sent: a size over the limit is refused from the header alone, before any body arrives."""
    with pytest.raises(BadInputError, match="exceeds the limit"):
        asyncio.run(_read_all(struct.pack(">I", size) + tail, eof=False))


def test_framing_reader_refuses_streams_that_end_inside_a_frame():
    frame = fuzz_cases.frame_bytes(wire.encode({"a": 1}, {"h": torch.zeros(4)})[0])
    for cut in range(1, len(frame)):
        with pytest.raises(BadInputError, match="stream ended"):
            asyncio.run(_read_all(frame[:cut], eof=True))
    assert len(asyncio.run(_read_all(frame * 3, eof=True))) == 3
