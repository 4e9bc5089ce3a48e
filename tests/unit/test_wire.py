"""The wire format: round trips, chunking under the frame limit, and refusal of bad messages."""

from __future__ import annotations

import msgpack
import pytest
import torch

from swarm import wire
from swarm.errors import BadInputError, MessageTooLargeError


def test_round_trip_small_and_dtypes():
    tensors = {
        "hidden": torch.randn(2, 3, 8),
        "mask": torch.ones(2, 3, dtype=torch.int64),
        "bf": torch.randn(4, dtype=torch.bfloat16),
    }
    frames = wire.encode({"kind": "forward", "x": [1, 2]}, tensors)
    assert len(frames) == 1
    meta, out = wire.decode(frames)
    assert meta == {"kind": "forward", "x": [1, 2]}
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_large_messages_are_split_below_the_frame_limit():
    big = torch.randn(3, 1024, 1024)  # 12 MiB
    frames = wire.encode({"a": 1}, {"first": torch.arange(5), "big": big, "last": torch.ones(3)})
    assert len(frames) >= 6
    assert all(f.ByteSize() < 4 * 1024 * 1024 for f in frames)
    meta, out = wire.decode(frames)
    assert torch.equal(out["big"], big) and torch.equal(out["last"], torch.ones(3))


def test_stream_of_messages_back_to_back():
    decoder = wire.Decoder()
    messages = [({"i": i}, {"h": torch.full((1, 600_000), float(i))}) for i in range(3)]
    got = []
    for meta, tensors in messages:
        for frame in wire.encode(meta, tensors):
            done = decoder.feed(frame)
            if done:
                got.append(done)
    assert [m["i"] for m, _ in got] == [0, 1, 2]
    assert all(float(t["h"][0, 0]) == i for i, (_, t) in enumerate(got))


def test_refuses_oversized_malformed_and_unknown_dtypes():
    frames = wire.encode({}, {"h": torch.zeros(1000)})
    with pytest.raises(MessageTooLargeError, match="larger than the limit"):  # a BadInputError: servers say bad_input
        wire.decode(frames, max_bytes=100)
    with pytest.raises(BadInputError, match="malformed metadata"):
        wire.decode([wire.Frame(metadata=b"\xc1")])
    with pytest.raises(BadInputError, match="malformed metadata"):
        wire.decode([wire.Frame(metadata=msgpack.packb([1, 2]))])
    with pytest.raises(BadInputError, match="cannot be sent"):
        wire.encode({}, {"b": torch.zeros(3, dtype=torch.bool)})
    frames = wire.encode({}, {"h": torch.zeros(3)})
    frames[0].tensors[0].dtype = "bool"
    with pytest.raises(BadInputError, match="not accepted"):
        wire.decode(frames)
    frames[0].tensors[0].dtype = "float32"
    frames[0].tensors[0].size[:] = [4]
    with pytest.raises(BadInputError, match="malformed tensor"):
        wire.decode(frames)
    with pytest.raises(BadInputError, match="ended before"):
        wire.decode([wire.Frame(metadata=msgpack.packb({"_tensors": ["h"]}))])
