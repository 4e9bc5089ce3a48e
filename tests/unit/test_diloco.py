"""DiLoCo's parts: the averaging codec (formats, sizes, hostile parts), top-k with error feedback, the outer step
against torch's own Nesterov SGD, and the run options."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import BadInputError
from swarm.training.codec import BLOCK, CodecError, decode, encode, encoded_bytes
from swarm.training.diloco import OuterSync, top_k
from swarm.training.run import Sync, load_run
from tests.helpers.runs import write_run


def _values(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 7])
def test_each_format_decodes_what_it_encoded_within_its_precision(n):
    x = _values(n)
    assert torch.equal(decode(encode(x, "none"), x.shape), x)
    message = encode(x, "int8")
    y = decode(message, x.shape)
    # each value within half a step of its block's scale (the block's largest magnitude / 127)
    for start in range(0, n, BLOCK):
        block = x[start : start + BLOCK]
        step = float(block.abs().max()) / 127
        assert float((y[start : start + BLOCK] - block).abs().max()) <= step / 2 + 1e-12
    sparse = top_k(x, 0.1)
    z = decode(encode(sparse, "topk"), x.shape)
    assert torch.equal(z != 0, sparse != 0)  # the same positions, values at 8 bits
    assert float((z - sparse).abs().max()) <= float(sparse.abs().max()) / 254 + 1e-12
    for fmt, nonzeros in (("none", n), ("int8", n), ("topk", int((sparse != 0).sum()))):
        assert len(encode(sparse if fmt == "topk" else x, fmt).buffer) == encoded_bytes(n, nonzeros, fmt)


def test_sparse_parts_cost_a_fraction_of_float32():
    x = top_k(_values(100_000), 0.01)
    assert len(encode(x, "topk").buffer) < 0.0135 * len(encode(x, "none").buffer)
    assert len(encode(_values(100_000), "int8").buffer) < 0.26 * 4 * 100_000


def _message(dtype: str, buffer: bytes, size: list[int]) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(buffer=buffer, size=size, dtype=dtype)


def test_hostile_parts_are_refused_by_name():
    good = encode(top_k(_values(1000), 0.05), "topk")
    cases = {
        "shape": (good.dtype, good.buffer, [999]),
        "length": (good.dtype, good.buffer + b"\0", [1000]),
        "format": ("float64", b"\0" * 8000, [1000]),
        "float32 length": ("float32", b"\0" * 3999, [1000]),
        "int8 length": ("swarm-int8", b"\0" * 1000, [1000]),
        "count": ("swarm-sparse8", np.array([2000], dtype=np.uint32).tobytes(), [1000]),
    }
    out_of_range = np.array([2], dtype=np.uint32).tobytes() + np.array([5, 1000], dtype=np.uint32).tobytes()
    cases["position"] = ("swarm-sparse8", out_of_range + np.ones(1, np.float32).tobytes() + b"\1\1", [1000])
    unordered = np.array([2], dtype=np.uint32).tobytes() + np.array([7, 7], dtype=np.uint32).tobytes()
    cases["order"] = ("swarm-sparse8", unordered + np.ones(1, np.float32).tobytes() + b"\1\1", [1000])
    nan_scale = np.full(4, np.nan, np.float32).tobytes() + b"\1" * 1000
    cases["scale"] = ("swarm-int8", nan_scale, [1000])
    for name, (dtype, buffer, size) in cases.items():
        with pytest.raises(CodecError):
            decode(_message(dtype, buffer, size), torch.Size([1000]))
            pytest.fail(name)


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "swarm-int8", "swarm-sparse8", "other"]),
    buffer=st.binary(max_size=600),
    size=st.integers(0, 300),
)
def test_any_bytes_decode_to_a_part_of_the_shape_or_a_codec_error(dtype, buffer, size):
    try:
        part = decode(_message(dtype, buffer, [size]), torch.Size([size]))
    except CodecError:
        return
    assert part.shape == (size,)


def test_top_k_with_error_feedback_loses_nothing_over_rounds():
    """What rounds send plus what is left over is exactly the sum of the rounds' pseudo-gradients."""
    p = torch.nn.Parameter(_values(5000, 1))
    outer = OuterSync([p], Sync(method="diloco", compression="topk", density=0.02, outer_lr=1.0, outer_momentum=0.0))
    total_whole, total_sent = torch.zeros(5000), torch.zeros(5000)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        with torch.no_grad():
            p.sub_(torch.randn(5000, generator=g) * 1e-3)  # the inner steps
        total_whole += outer.anchor[0] - p.detach()
        sent = outer.prepare()[0]
        assert int((sent != 0).sum()) == 100  # 2% of the values
        total_sent += sent
        outer.step(outer.buffers)  # as if the group's average were this party's own
    assert torch.allclose(total_sent + outer.error[0], total_whole, atol=1e-6)


def test_the_outer_step_is_torch_nesterov_sgd_on_the_pseudo_gradient():
    sync = Sync(method="diloco", outer_lr=0.7, outer_momentum=0.9)
    p = torch.nn.Parameter(_values(300, 3))
    reference = torch.nn.Parameter(p.detach().clone())
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterSync([p], sync)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        drift = torch.randn(300, generator=g) * 1e-3
        with torch.no_grad():
            p.add_(drift)  # inner steps move the weights; the reference starts each round where the outer step put it
        reference.grad = -drift.clone()  # start minus end
        opt.step()
        outer.step()
        assert torch.allclose(p.detach(), reference.detach(), atol=1e-7)
        assert torch.equal(outer.anchor[0], p.detach())


def test_run_options(tmp_path):
    run = load_run(write_run(tmp_path, averaging={"method": "diloco", "compression": "topk", "density": 0.02}))
    assert run.sync == Sync(method="diloco", compression="topk", density=0.02)
    assert load_run(write_run(tmp_path)).sync == Sync()
    with pytest.raises(BadInputError, match="needs method"):
        load_run(write_run(tmp_path, averaging={"compression": "int8"}))
    with pytest.raises(BadInputError, match="density"):
        load_run(write_run(tmp_path, averaging={"method": "diloco", "density": 0.0}))


def test_a_round_that_overlapped_inner_steps_keeps_their_progress_on_the_new_start():
    sync = Sync(method="diloco", outer_lr=0.7, outer_momentum=0.9)
    p = torch.nn.Parameter(_values(200, 5))
    outer = OuterSync([p], sync)
    with torch.no_grad():
        p.sub_(1e-3)  # the round's inner steps
    outer.prepare()
    since = [p.detach().clone()]
    outcome = outer.outcome(outer.buffers)  # what the round's thread computes, changing nothing
    assert torch.equal(p.detach(), since[0]) and not torch.equal(outcome.anchor[0], outer.anchor[0])
    with torch.no_grad():
        p.add_(2e-4)  # inner steps taken while the round ran
    outer.adopt(outcome, since=since)
    assert torch.allclose(p.detach(), outcome.anchor[0] + 2e-4, atol=1e-7)
    assert torch.equal(outer.anchor[0], outcome.anchor[0])


def test_replica_cross_checks_are_refused_under_diloco(tmp_path):
    from swarm.client.training.crosscheck import CrossChecker

    run = load_run(write_run(tmp_path, averaging={"method": "diloco"}))
    with pytest.raises(BadInputError, match="DiLoCo"):
        CrossChecker(None, run)  # type: ignore[arg-type]  # refused before it touches the connection
