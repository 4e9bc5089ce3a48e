"""Malformed frames and messages, made deterministically from a ``random.Random``: the wire fuzz tests (hypothesis
draws the generator's seed), the live-server fuzz test and ``scripts/fuzz.py`` share them.

Two families:
- ``wire_junk``: frames the wire decoder must refuse or decode without surprises (random bytes as metadata, msgpack of
  the wrong shape, tensor parts of wrong sizes, dtypes and chunk counts, names lists that lie);
- ``request_junk``: well-formed wire messages whose request is wrong in a way every server must refuse (a forward
  request with a broken field, shape, dtype or span; an inference step without a session).
``stream_junk`` is raw bytes for the direct plane's framing (lengths that lie, truncation, garbage).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import msgpack
import torch

from swarm import wire
from swarm.protocol import PROTOCOL_VERSION

HIDDEN = 64  # the tiny test models' hidden size
BLOCKS = 4  # ...and their block count
U32 = (1 << 32) - 1


def _junk_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(10 if depth < 3 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if choice == 3:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), 1e308])
    if choice == 4:
        return "".join(rng.choice("ab_\x00é\U0001f600") for _ in range(rng.randrange(0, 12)))
    if choice == 5:
        return rng.randbytes(rng.randrange(0, 16))
    if choice in (6, 7):
        return [_junk_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if choice == 8:
        return msgpack.ExtType(rng.randrange(0, 127), rng.randbytes(rng.randrange(0, 8)))
    return {str(_junk_value(rng, depth + 1)): _junk_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _pack(value: object) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


def _part(rng: random.Random) -> wire.TensorPart:
    part = wire.TensorPart()
    kind = rng.randrange(6)
    dtype = rng.choice([*wire.DTYPES, "bool", "", "float8", "\x00", "int64 "])
    itemsize = wire.DTYPES[dtype].itemsize if dtype in wire.DTYPES else 1
    if kind == 0:  # an honest-looking part
        shape = [rng.randrange(0, 4) for _ in range(rng.randrange(0, 4))]
        numel = 1
        for d in shape:
            numel *= d
        part.buffer = rng.randbytes(numel * itemsize)
    elif kind == 1:  # a size that does not fit the bytes
        shape = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 4))]
        part.buffer = rng.randbytes(rng.randrange(0, 64))
    elif kind == 2:  # huge declared sizes, few bytes
        shape = [rng.choice([U32, 2**31, 0, 1, 65536]) for _ in range(rng.randrange(1, 6))]
        part.buffer = rng.randbytes(rng.randrange(0, 32))
    elif kind == 3:  # many dimensions
        shape = [rng.choice([0, 1, 1, 1, 2]) for _ in range(rng.randrange(20, 80))]
        part.buffer = rng.randbytes(rng.choice([0, itemsize, 2 * itemsize]))
    elif kind == 4:  # nothing but a buffer
        shape = []
        part.buffer = rng.randbytes(rng.randrange(0, 64))
    else:  # bytes for a shape but the wrong dtype's worth
        shape = [rng.randrange(1, 4), rng.randrange(1, 4)]
        part.buffer = rng.randbytes(shape[0] * shape[1] * rng.choice([1, 3, 5, 16]))
    part.size.extend(shape)
    part.dtype = dtype
    part.compression = rng.choice([0, 0, 0, 1, 2, 5, 99])
    part.chunks = rng.choice([0, 0, 1, 1, 2, 3, 2**31 - 1, -1, -(2**31)])
    return part


def _names(rng: random.Random) -> object:
    kind = rng.randrange(8)
    if kind < 4:
        return [rng.choice(["hidden", "a", "", "x" * 200, "hidden"]) for _ in range(rng.randrange(0, 5))]
    if kind == 4:
        return [_junk_value(rng) for _ in range(rng.randrange(1, 4))]  # not strings
    if kind == 5:
        return _junk_value(rng)  # not a list
    if kind == 6:
        return [str(i) for i in range(rng.choice([100, wire.MAX_TENSORS + 1]))]  # more names than parts, or too many
    return None  # no names at all


def _metadata(rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 64))  # random bytes
    if kind == 1:
        return _pack(_junk_value(rng))  # msgpack of the wrong shape
    if kind == 2:  # a map with junk keys
        return b"\x82" + _pack(_junk_value(rng)) + _pack(1) + _pack("_tensors") + _pack([])
    if kind == 3:  # truncated or extended msgpack
        raw = _pack({"_tensors": ["hidden"], "kind": "forward", "start": 0, "end": BLOCKS})
        return raw[: rng.randrange(len(raw))] if rng.random() < 0.5 else raw + rng.randbytes(rng.randrange(1, 8))
    if kind == 4:  # lengths that lie: array/map/str/bin headers declaring 2**32 - 1 items or bytes
        return rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]) + b"\xff\xff\xff\xff" + rng.randbytes(4)
    if kind == 5:  # deep nesting
        return b"\x91" * rng.randrange(500, 5000) + b"\xc0"
    meta: dict[str, object] = {"_tensors": _names(rng)}
    for _ in range(rng.randrange(0, 4)):
        meta[rng.choice(["kind", "start", "end", "protocol_version", "open", "step"])] = _junk_value(rng)
    return _pack(meta)


def wire_junk(rng: random.Random) -> list[wire.Frame]:
    """One to four frames of one message that lies about itself somewhere."""
    frames = []
    for i in range(rng.choice([1, 1, 1, 2, 4])):
        frame = wire.Frame(uid=rng.choice(["", "x", "\x00" * 3]))
        if i == 0 or rng.random() < 0.2:
            frame.metadata = _metadata(rng)
        frame.tensors.extend(_part(rng) for _ in range(rng.choice([0, 1, 1, 2, 3, 8])))
        frames.append(frame)
    return frames


_FORWARD_BREAKS: list[tuple[str, Callable[[random.Random, dict[str, object], dict[str, torch.Tensor]], None]]] = [
    ("kind", lambda r, m, t: m.update(kind=r.choice(["sideways", "", 7, None]))),
    ("version", lambda r, m, t: m.update(protocol_version=r.choice([PROTOCOL_VERSION + 1, 1, "3", None, -1]))),
    ("no_version", lambda r, m, t: m.pop("protocol_version")),
    (
        "span",
        lambda r, m, t: m.update(start=r.choice([-1, 3, BLOCKS, 2**40, "zero"]), end=r.choice([0, 2, BLOCKS + 3])),
    ),
    ("extra_field", lambda r, m, t: m.update(extras={"x": 1}, bogus=_junk_value(r))),
    ("field_type", lambda r, m, t: m.update(keep_for_backward="perhaps", forward_id=[1, r.randrange(9)])),
    ("adapter", lambda r, m, t: m.update(adapter={"client": "short", "version": -1, "has_tensors": "x"})),
    ("no_hidden", lambda r, m, t: t.clear()),
    ("hidden_dim", lambda r, m, t: t.update(hidden=torch.zeros(1, r.randrange(1, 5), HIDDEN + r.choice([-1, 1, 7])))),
    (
        "hidden_rank",
        lambda r, m, t: t.update(hidden=torch.zeros(*[r.randrange(1, 4) for _ in range(r.choice([1, 2, 4]))])),
    ),
    (
        "hidden_dtype",
        lambda r, m, t: t.update(
            hidden=torch.zeros(1, 2, HIDDEN, dtype=r.choice([torch.float64, torch.int64, torch.float16]))
        ),
    ),
    ("too_long", lambda r, m, t: t.update(hidden=torch.zeros(2, 300, HIDDEN))),  # the test servers take 512 tokens
    (
        "mask",
        lambda r, m, t: t.update(
            attention_mask=torch.ones(1, r.randrange(5, 9), dtype=r.choice([torch.int64, torch.float32]))
        ),
    ),
    (
        "stray_tensor",
        lambda r, m, t: t.update({r.choice(["lora.x.A", "deep.0", "lora.9.q.A"]): torch.zeros(2, HIDDEN)}),
    ),
    ("backward_unknown", lambda r, m, t: m.update(kind="backward", forward_id="never-" + str(r.randrange(10**9)))),
]


def request_junk(rng: random.Random) -> tuple[str, dict[str, object], dict[str, torch.Tensor]]:
    """A well-formed wire message carrying a forward request that one sure fault makes invalid: (fault, meta,
    tensors). The server must answer it with an error reply and keep the connection's loop going."""
    meta: dict[str, object] = {"protocol_version": PROTOCOL_VERSION, "kind": "forward", "start": 0, "end": BLOCKS}
    tensors = {"hidden": torch.zeros(1, rng.randrange(1, 4), HIDDEN)}
    name, brk = rng.choice(_FORWARD_BREAKS)
    brk(rng, meta, tensors)
    return name, meta, tensors


def inference_junk(rng: random.Random) -> tuple[str, dict[str, object], dict[str, torch.Tensor]]:
    """A first message of an inference stream that cannot open a session."""
    meta: dict[str, object] = {"protocol_version": PROTOCOL_VERSION}
    kind = rng.randrange(4)
    if kind == 0:
        meta["step"] = {"position": rng.randrange(0, 9)}  # a step without a session
    elif kind == 1:
        meta["open"] = {"session_id": "s" * rng.choice([0, 200]), "start": 0, "end": BLOCKS, "max_length": -1}
    elif kind == 2:
        meta["open"] = {"session_id": ["f"], "start": 0, "end": BLOCKS, "batch_size": 0}
    else:
        meta["open"] = _junk_value(rng)
        meta["step"] = _junk_value(rng)
    return f"inference_{kind}", meta, {"hidden": torch.zeros(1, 1, HIDDEN)}


def frame_bytes(frame: wire.Frame) -> bytes:
    data = frame.SerializeToString()
    return struct.pack(">I", len(data)) + data


def stream_junk(rng: random.Random) -> tuple[str, bytes, bool]:
    """Raw bytes for the direct plane's framing: (kind, bytes, complete). ``complete`` is False where the bytes end
    inside a frame (the reader must be told the stream ended to refuse it); True where they hold a refusable frame."""
    kind = rng.randrange(6)
    if kind == 0:  # a declared size beyond the frame limit
        return (
            "oversize",
            struct.pack(">I", rng.randrange(2 * wire.FRAME_BYTES + 65537, 1 << 32)) + rng.randbytes(8),
            True,
        )
    if kind == 1:  # a size within the limit, far fewer bytes
        return (
            "short",
            struct.pack(">I", rng.randrange(1024, 2 * wire.FRAME_BYTES)) + rng.randbytes(rng.randrange(0, 64)),
            False,
        )
    if kind == 2:  # a cut header
        return "cut_header", rng.randbytes(rng.randrange(1, 4)), False
    if kind == 3:  # a frame that is not a protobuf message
        body = b"\xff" + rng.randbytes(rng.randrange(0, 40))
        return "garbage", struct.pack(">I", len(body)) + body, True
    if kind == 4:  # a real frame with flipped bytes (may still parse: then the decoder judges it)
        data = bytearray(wire.encode({"_x": 1}, {"h": torch.zeros(3)})[0].SerializeToString())
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return "flipped", struct.pack(">I", len(data)) + bytes(data), True
    frames = wire_junk(rng)  # well-framed junk messages
    return "wire_junk", b"".join(frame_bytes(f) for f in frames), True
