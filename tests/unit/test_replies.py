"""What a server replies is bounded by what the client asked, checked against it, and every way it can be wrong
becomes a failure that names the server (never a raw KeyError or ValueError for the user)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm import wire
from swarm.client.replies import Expect, checked, distrust, expected
from swarm.errors import (
    BadInputError,
    BusyError,
    DhtLostError,
    MessageTooLargeError,
    PeerUnavailableError,
    SessionLengthError,
    StaleStepError,
    SwarmError,
    WrongReplyError,
)
from swarm.protocol import BackwardRequest, ErrorReply, ForwardRequest, InferenceRequest, InferenceStep, Reply

HIDDEN = torch.randn(2, 7, 64)
LORA = {"lora.0.self_attn.q_proj.A": torch.randn(4, 64), "lora.0.self_attn.q_proj.B": torch.zeros(64, 4)}


def reply_size(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes an honest server's reply takes on the wire (what the transport's decoder counts)."""
    return wire.encoded_size(wire.encode(Reply().model_dump(mode="json"), tensors))


def declared(code: str, message: str = "no") -> SwarmError:
    return ErrorReply(code=code, error=message).exception("peer-a")


# ---- bounds -----------------------------------------------------------------------------------------------------
def test_forward_bound_fits_the_honest_reply_and_little_more():
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": HIDDEN})
    honest = reply_size({"hidden": HIDDEN})
    assert honest <= expect.max_bytes < honest + 8 * 1024
    # a longer hidden state (or a second one) is over the bound
    prompt = torch.randn(2, 100, 64)
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": prompt})
    assert reply_size({"hidden": prompt}) <= expect.max_bytes < reply_size({"hidden": torch.randn(2, 120, 64)})


def test_large_replies_cut_in_many_frames_still_fit():
    big = torch.randn(4, 4096, 64, dtype=torch.float16)  # 2 MiB+: several parts
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": big})
    assert reply_size({"hidden": big}) <= expect.max_bytes < reply_size({"hidden": big}) * 1.01


def test_backward_bound_counts_grad_input_and_the_adapters_gradients():
    grad = torch.randn(2, 7, 64)
    request = BackwardRequest(start=0, end=1, forward_id="f")
    expect = expected(request, {"grad_output": grad}, LORA)
    assert set(expect.tensors) == {"grad_input", "grad.lora.0.self_attn.q_proj.A", "grad.lora.0.self_attn.q_proj.B"}
    honest = {"grad_input": grad, **{f"grad.{n}": torch.randn_like(t) for n, t in LORA.items()}}
    assert reply_size(honest) <= expect.max_bytes
    frozen = expected(request.model_copy(update={"input_grad": False}), {"grad_output": grad}, LORA)
    assert "grad_input" not in frozen.tensors and frozen.max_bytes < expect.max_bytes - grad.nbytes + 1


def test_inference_step_expects_its_hidden_back():
    step = InferenceRequest(step=InferenceStep(position=3))
    expect = expected(step, {"hidden": HIDDEN[:, :1], "position_ids": torch.tensor([[3], [3]])})
    assert dict(expect.tensors) == {"hidden": ((2, 1, 64), torch.float32)}


# ---- validation -------------------------------------------------------------------------------------------------
def run_checked(expect: Expect, reply: dict[str, torch.Tensor] | BaseException) -> dict[str, torch.Tensor]:
    async def call() -> dict[str, torch.Tensor]:
        if isinstance(reply, BaseException):
            raise reply
        return reply

    return asyncio.run(checked("peer-a", expect, call()))


@pytest.mark.parametrize(
    "reply, why",
    [
        ({}, "replied with tensors"),
        ({"hidden_states": HIDDEN}, "replied with tensors"),
        ({"hidden": HIDDEN, "extra": HIDDEN}, "replied with tensors"),
        ({"hidden": HIDDEN[:, :3]}, r"replied hidden \[2, 3, 64\]"),
        ({"hidden": HIDDEN.double()}, "torch.float64"),
        ({"hidden": torch.full_like(HIDDEN, float("nan"))}, "NaN"),
        ({"hidden": torch.full_like(HIDDEN, float("inf"))}, "NaN or infinite"),
    ],
)
def test_malformed_replies_ban_the_server(reply, why):
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": HIDDEN})
    with pytest.raises(PeerUnavailableError, match=why) as info:
        run_checked(expect, reply)
    assert info.value.peer_id == "peer-a" and info.value.retriable
    assert isinstance(info.value, WrongReplyError)  # what callers and tests read, rather than the text


def test_honest_replies_pass_and_non_finite_inputs_may_come_back_non_finite():
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": HIDDEN})
    assert run_checked(expect, {"hidden": HIDDEN})["hidden"] is HIDDEN
    poisoned = HIDDEN.clone()
    poisoned[0, 0, 0] = float("nan")  # the user's own NaN: an honest server passes it on
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": poisoned})
    assert not expect.finite
    run_checked(expect, {"hidden": torch.full_like(HIDDEN, float("nan"))})


def test_backward_reply_must_hold_every_adapter_gradient_of_its_shape():
    grad = torch.randn(2, 7, 64)
    expect = expected(BackwardRequest(start=0, end=1, forward_id="f"), {"grad_output": grad}, LORA)
    honest = {"grad_input": grad, **{f"grad.{n}": torch.randn_like(t) for n, t in LORA.items()}}
    assert run_checked(expect, honest) is honest
    with pytest.raises(PeerUnavailableError, match="replied with tensors"):
        run_checked(expect, {"grad_input": grad})
    wrong = dict(honest, **{"grad.lora.0.self_attn.q_proj.A": torch.randn(8, 64)})
    with pytest.raises(PeerUnavailableError, match=r"grad.lora.0.self_attn.q_proj.A \[8, 64\]"):
        run_checked(expect, wrong)


# ---- errors -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", ["swarm_error", "some_code_of_a_newer_version", "dht_lost", "missing_blocks"])
def test_a_servers_internal_failure_or_unknown_code_is_a_retriable_failure(code):
    e = distrust(declared(code, "server error: OutOfMemoryError: CUDA out of memory"), "peer-a")
    assert isinstance(e, PeerUnavailableError) and e.retriable and e.peer_id == "peer-a"
    assert "out of memory" in str(e)
    assert isinstance(e.cause, SwarmError) and e.cause.declared  # what the server named, kept underneath
    assert isinstance(declared("dht_lost"), DhtLostError)


def test_a_reply_the_transport_could_not_read_is_the_servers_fault():
    local = MessageTooLargeError("message larger than the limit of 70000 bytes")  # raised by this side's decoder
    local.peer_id = "peer-a"
    expect = expected(ForwardRequest(start=0, end=2), {"hidden": HIDDEN})
    with pytest.raises(PeerUnavailableError, match="larger than the limit") as info:
        run_checked(expect, local)
    assert info.value.peer_id == "peer-a" and info.value.cause is local
    assert not isinstance(info.value, WrongReplyError)


@pytest.mark.parametrize(
    "error, cls",
    [
        (declared("bad_input"), BadInputError),
        (declared("session_length"), SessionLengthError),
        (ErrorReply(code="stale_step", error="behind", server_step=4).exception("peer-a"), StaleStepError),
        (declared("busy"), BusyError),
    ],
)
def test_what_a_server_declares_about_the_request_stays_what_it_is(error, cls):
    e = distrust(error, "peer-a")
    assert type(e) is cls and e.declared and e.peer_id == "peer-a"
