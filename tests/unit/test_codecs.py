"""Activation codecs: round-trip error per codec, the per-link choice, and hostile compressed tensors."""

from __future__ import annotations

import math
import struct
import tracemalloc

import numpy as np
import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm import codecs, wire
from swarm.codecs import ACTIVATIONS, Codec, choose_codec, parse_codec
from swarm.errors import BadInputError
from tests.helpers.examples import fuzz_examples

LOSSY = [c for c in Codec if c != Codec.none]


def _hidden(seed: int = 0) -> torch.Tensor:
    """Residual-stream-like: mostly small values, two outlier channels ~100x larger (as in real transformers)."""
    x = torch.randn(2, 33, 96, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 100
    x[..., 50] *= 30
    return x


def roundtrip(tensors: dict[str, torch.Tensor], codec: Codec | None) -> tuple[dict[str, torch.Tensor], int]:
    frames = wire.encode({"k": 1}, tensors, codec)
    meta, out = wire.decode(frames)
    assert meta == {"k": 1}
    return out, wire.encoded_size(frames)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_shape_dtype_and_error_bounds(codec, dtype):
    x = _hidden().to(dtype)
    out, _ = roundtrip({"hidden": x}, codec)
    y = out["hidden"]
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    bound = {Codec.none: 0.0, Codec.float16: 1e-3, Codec.bfloat16: 5e-3, Codec.block8: 5e-3}
    if codec in bound:
        assert rel <= bound[codec] + (4e-3 if dtype != torch.float32 else 0.0)
    else:  # hivemind's per-tensor 8-bit codecs: bounded, but outlier channels cost them most of their range
        assert rel < 1.0


def test_block8_is_accurate_per_value_and_about_4x_smaller():
    x = _hidden()[:, :32].contiguous()  # whole blocks
    out, size = roundtrip({"hidden": x}, Codec.block8)
    _, raw = roundtrip({"hidden": x}, None)
    assert raw / size >= 3.5
    blocks = x.reshape(-1, codecs.BLOCK)
    second = blocks.abs().topk(2, dim=1).values[:, 1:]  # the scale once the outlier is out
    err = (out["hidden"] - x).reshape(-1, codecs.BLOCK).abs()
    assert bool((err <= second / 127 + 1e-6).all())  # sqrt companding: at most one linear step anywhere
    assert torch.equal(out["hidden"].reshape(-1, codecs.BLOCK).abs().amax(1), blocks.abs().amax(1))  # outlier exact


def test_only_activations_are_compressed():
    tensors = {
        "hidden": torch.randn(1, 64, 32),
        "attention_mask": torch.ones(1, 64, dtype=torch.int64),
        "lora.0.q_proj.A": torch.randn(8, 32),
        "payload": torch.randn(4096),
    }
    frames = wire.encode({}, tensors, Codec.block8)
    parts = {p.compression for f in frames for p in f.tensors}
    assert parts == {0, codecs.WIRE_IDS[Codec.block8]}
    out, _ = roundtrip(tensors, Codec.block8)
    for name in ("attention_mask", "lora.0.q_proj.A", "payload"):
        assert torch.equal(out[name], tensors[name])
    assert ACTIVATIONS == {"hidden", "grad_output", "grad_input"}


def test_non_finite_and_tiny_tensors_travel_exact():
    x = torch.randn(4, 300)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    for codec in (Codec.block8, Codec.quantile8, Codec.uint8):
        out, _ = roundtrip({"hidden": x}, codec)
        assert torch.equal(out["hidden"].isnan(), x.isnan())
        assert torch.equal(out["hidden"][~x.isnan()], x[~x.isnan()])  # sent as is: NaN stays NaN, not bad_input
    one = torch.randn(1, 1, 3)
    out, _ = roundtrip({"hidden": one}, Codec.quantile8)  # a 1 KiB codebook is larger than the tensor
    assert torch.equal(out["hidden"], one)
    out, _ = roundtrip({"hidden": torch.zeros(0, 5)}, Codec.block8)
    assert out["hidden"].shape == (0, 5)


def test_choose_codec():
    mib = 1 << 20
    assert choose_codec(mib, None) == Codec.none  # unknown link: exact
    assert choose_codec(mib, 10_000.0) == Codec.none  # 0.8 ms of float32 on 10 Gbps: not worth any CPU
    assert choose_codec(2304, 50.0) == Codec.none  # one token's hidden state: latency, not bandwidth
    assert choose_codec(mib, 1000.0) == Codec.float16  # 8 ms on 1 Gbps: halve it
    assert choose_codec(mib, 50.0) == Codec.block8  # the link is the bottleneck: 8-bit
    assert choose_codec(2304, 1.0) == Codec.block8  # 18 ms for one token on 1 Mbps
    assert choose_codec(mib, 50.0, eight_bit=Codec.quantile8) == Codec.quantile8
    assert choose_codec(1, None, forced=Codec.bfloat16) == Codec.bfloat16  # forced wins
    assert choose_codec(mib, 0.0) == Codec.none
    assert parse_codec("auto") is None and parse_codec("block8") == Codec.block8
    with pytest.raises(BadInputError, match="unknown codec"):
        parse_codec("zip")


def _part(compression: int, buffer: bytes, size: list[int], dtype: str = "float32") -> wire.Frame:
    frames = wire.encode({}, {"hidden": torch.zeros(1)})
    part = frames[0].tensors[0]
    part.compression, part.buffer, part.dtype = compression, buffer, dtype
    del part.size[:]
    part.size.extend(size)
    return frames


def _block8(block: int, scales: list[float], outliers: list[float], index: list[int], codes: bytes) -> bytes:
    return b"".join(
        (
            struct.pack("<I", block),
            np.asarray(scales, "<f4").tobytes(),
            np.asarray(outliers, "<f4").tobytes(),
            bytes(index),
            codes,
        )
    )


B8, Q8, U8, F16, BF16 = (
    codecs.WIRE_IDS[c] for c in (Codec.block8, Codec.quantile8, Codec.uint8, Codec.float16, Codec.bfloat16)
)
CODEBOOK = np.int64(256).tobytes() + np.zeros(256, "<f4").tobytes()
MALFORMED = {
    "float16 short": (F16, b"\0" * 7, [2, 2]),
    "bfloat16 long": (BF16, b"\0" * 10, [2, 2]),
    "huge claimed size": (F16, b"\0" * 8, [1 << 31, 1 << 31, 1 << 31]),
    "unknown compression": (99, b"\0" * 16, [4]),
    "hivemind meanstd": (runtime_pb2.CompressionType.MEANSTD_16BIT, b"\0" * 16, [4]),
    "hivemind blockwise": (runtime_pb2.CompressionType.BLOCKWISE_8BIT, b"\0" * 16, [4]),
    "codebook size": (Q8, np.int64(1 << 40).tobytes() + b"\0" * 64, [4]),
    "negative codebook size": (U8, np.int64(-3).tobytes() + b"\0" * 64, [4]),
    "codebook short": (Q8, CODEBOOK[:100], [4]),
    "indices short": (Q8, CODEBOOK + b"\0" * 3, [4]),
    "nan codebook": (U8, np.int64(256).tobytes() + np.full(256, np.nan, "<f4").tobytes() + b"\0" * 4, [4]),
    "empty block8": (B8, b"", [4]),
    "block size 0": (B8, _block8(0, [1.0], [0.0], [0], b"\0" * 4), [4]),
    "block size 3": (B8, _block8(3, [1.0, 1.0], [0.0, 0.0], [0, 0], b"\0" * 4), [4]),
    "block size huge": (B8, _block8(1 << 30, [1.0], [0.0], [0], b"\0" * 4), [4]),
    "block count": (B8, _block8(16, [1.0, 1.0], [0.0, 0.0], [0, 0], b"\0" * 4), [4]),
    "nan scale": (B8, _block8(16, [float("nan")], [0.0], [0], b"\0" * 4), [4]),
    "inf scale": (B8, _block8(16, [float("inf")], [0.0], [0], b"\0" * 4), [4]),
    "negative scale": (B8, _block8(16, [-1.0], [0.0], [0], b"\0" * 4), [4]),
    "inf outlier": (B8, _block8(16, [1.0], [float("-inf")], [0], b"\0" * 4), [4]),
    "outlier index": (B8, _block8(16, [1.0], [0.0], [16], b"\0" * 4), [4]),
    "codes short": (B8, _block8(16, [1.0], [0.0], [0], b"\0" * 3), [4]),
    "bad dtype": (B8, _block8(16, [1.0], [0.0], [0], b"\0" * 4), [4], "int64"),
    "hostile dtype": (F16, b"\0" * 8, [4], "Tensor"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_compressed_tensors_are_bad_input(case):
    frames = _part(*MALFORMED[case])
    with pytest.raises(BadInputError, match="malformed|not accepted"):
        wire.decode(frames)


def test_valid_hand_built_block8_decodes():
    codes = bytes([127, 0, 256 - 127, 64])
    frames = _part(B8, _block8(16, [2.0], [-5.0], [1], codes), [4])
    out = wire.decode(frames)[1]["hidden"]
    assert torch.allclose(out, torch.tensor([2.0, -5.0, -2.0, 2.0 * (64 / 127) ** 2]))


def test_fuzzed_compressed_parts_never_crash():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=fuzz_examples(300), deadline=None, derandomize=True)
    @hypothesis.given(
        compression=st.sampled_from([B8, Q8, U8, F16, BF16, 1, 5, 99]),
        buffer=st.binary(max_size=2048),
        size=st.lists(st.integers(0, (1 << 32) - 1), max_size=4),
        dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", "x"]),
    )
    def check(compression, buffer, size, dtype):
        try:
            out = wire.decode(_part(compression, buffer, size, dtype))[1]["hidden"]
        except BadInputError:
            return
        assert out.numel() <= len(buffer) + 1  # never more values than bytes sent (one per 8-bit code)

    check()


def test_fuzzed_valid_tensors_round_trip():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=fuzz_examples(60), deadline=None, derandomize=True)
    @hypothesis.given(
        shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
        codec=st.sampled_from(LOSSY),
        scale=st.floats(1e-6, 1e4),
    )
    def check(shape, codec, scale):
        x = torch.randn(shape) * scale
        y = roundtrip({"grad_output": x}, codec)[0]["grad_output"]
        assert y.shape == x.shape and bool(torch.isfinite(y).all())
        if codec in (Codec.float16, Codec.bfloat16, Codec.block8) and x.numel():
            assert (y - x).norm() <= 0.05 * x.norm() + 1e-3

    check()


def test_link_estimates():
    from swarm.rpc.links import Links

    links = Links(smoothing=0.5)
    assert links.mbps("a") is None and links.mbps("a", prior=100.0) == 100.0
    assert links.mbps("a", prior=0.0) is None  # a zero or missing announcement is unknown, not a dead link
    links.observe("a", 1000, 0.5, prior=100.0)  # small: latency and compute, not bandwidth
    assert links.mbps("a", prior=100.0) == 100.0
    links.observe("a", 1 << 20, 8 * (1 << 20) / 50e6, prior=100.0)  # a 1 MiB exchange at 50 Mbps
    assert links.mbps("a", prior=100.0) == pytest.approx(75.0)
    links.observe("b", 1 << 20, 8 * (1 << 20) / 10e6)  # no prior: the first sample
    assert links.mbps("b") == pytest.approx(10.0)
    assert choose_codec(1 << 20, links.mbps("b")) == Codec.block8


# ---- memory: a part costs its output (within the caller's limit) and a constant, checked before allocating ---------
SLACK = 32 * codecs.CHUNK  # a codec's working buffers: a few chunks of float32


def _traced_peak(fn):
    """``fn()``'s result (or the BadInputError it raised) and the peak bytes it allocated on top of what was there:
    numpy's allocations included, so the output buffer of ``decompress`` is seen."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            result = fn()
        except BadInputError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _honest(codec: Codec, numel: int, dtype: torch.dtype = torch.float64):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    part = codecs.compress(x, codec, str(dtype).removeprefix("torch."))
    assert part is not None
    return part


@pytest.mark.parametrize("codec", LOSSY)
def test_a_lying_header_is_refused_before_anything_is_allocated(codec):
    part = _honest(codec, 4096)
    del part.size[:]
    part.size.extend([1 << 20, 1 << 21])  # 2^41 values: 16 TiB of float64 if believed
    refused, peak = _traced_peak(lambda: codecs.decompress(part))
    assert isinstance(refused, BadInputError) and "malformed" in str(refused)
    assert peak < 2 * len(part.buffer) + SLACK  # the buffer read once, nothing the size of the claim


@pytest.mark.parametrize("codec", LOSSY)
def test_a_part_decodes_within_its_limit_or_not_at_all(codec):
    numel = 3 * codecs.CHUNK + 5  # several chunks and a partial block
    part = _honest(codec, numel)
    out_bytes = numel * 8  # float64: 4x to 8x the wire bytes
    refused, peak = _traced_peak(lambda: codecs.decompress(part, out_bytes - 1))
    assert isinstance(refused, BadInputError) and "over the limit" in str(refused)
    assert peak < 2 * len(part.buffer) + SLACK  # no output was allocated
    out, peak = _traced_peak(lambda: codecs.decompress(part, out_bytes))
    assert isinstance(out, torch.Tensor) and out.shape == (numel,) and out.dtype == torch.float64
    assert out_bytes <= peak <= out_bytes + len(part.buffer) + SLACK  # the output, the buffer, chunk buffers


def test_a_message_decodes_within_its_limit():
    tensors = {"hidden": torch.randn(4096).double(), "grad_output": torch.randn(4096).double()}
    frames = wire.encode({}, tensors, Codec.float16)  # 16 KiB on the wire, 64 KiB decoded
    assert wire.encoded_size(frames) < 20_000
    with pytest.raises(BadInputError, match="over the limit"):
        wire.decode(frames, max_bytes=64 * 1024 - 1)  # each tensor fits, both together do not
    assert wire.decode(frames, max_bytes=64 * 1024)[1].keys() == tensors.keys()


def _consistent(codec: Codec, numel: int, data: bytes, block_log: int) -> bytes:
    """A buffer of the exact layout ``codec`` implies for ``numel`` values, its fields valid, its values from
    ``data``."""
    rng = np.random.default_rng(list(data) or [0])
    codes = rng.integers(0, 256, numel, dtype=np.uint8).tobytes()
    if codec in (Codec.float16, Codec.bfloat16):
        return rng.standard_normal(numel).astype("<f2").tobytes() if codec == Codec.float16 else codes + codes
    if codec in (Codec.uint8, Codec.quantile8):
        return np.int64(256).tobytes() + rng.standard_normal(256).astype("<f4").tobytes() + codes
    block = 1 << block_log
    blocks = -(-numel // block)
    scales = np.abs(rng.standard_normal(blocks)).astype("<f4").tobytes()
    index = rng.integers(0, block, blocks, dtype=np.uint8).tobytes()
    return struct.pack("<I", block) + scales + rng.standard_normal(blocks).astype("<f4").tobytes() + index + codes


def test_fuzzed_headers_decode_within_their_limit_or_are_refused():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=fuzz_examples(200), deadline=None, derandomize=True)
    @hypothesis.given(
        codec=st.sampled_from(LOSSY),
        dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
        shape=st.lists(st.integers(0, 300), min_size=1, max_size=3),
        lie=st.sampled_from([1, 1, 1, 2, 0, 1 << 16, 1 << 24]),  # the shape claimed: the true one, or scaled
        block_log=st.integers(4, 8),
        data=st.binary(max_size=8),
        max_bytes=st.integers(0, 1 << 22),
    )
    def check(codec, dtype, shape, lie, block_log, data, max_bytes):
        numel = math.prod(shape)
        buffer = _consistent(codec, numel, data, block_log)
        claimed = [min(shape[0] * lie, (1 << 32) - 1), *shape[1:]]  # (a size is a uint32)
        part = _part(codecs.WIRE_IDS[codec], buffer, claimed, dtype)[0].tensors[0]
        result, peak = _traced_peak(lambda: codecs.decompress(part, max_bytes))
        if isinstance(result, BadInputError):
            assert peak < 2 * len(buffer) + SLACK  # refused before the output was allocated
            return
        out_bytes = result.numel() * result.element_size()
        assert lie == 1 or numel == 0  # a shape the buffer does not hold is never believed
        assert result.numel() == numel and out_bytes <= max_bytes
        assert out_bytes <= peak <= out_bytes + 2 * len(buffer) + SLACK

    check()
