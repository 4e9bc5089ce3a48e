"""The typed messages: every request kind parses into its own model, anything else is refused, another protocol
version is refused before parsing, and error replies carry typed fields (a stale step's server step)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from swarm.errors import BadInputError, PeerUnavailableError, StaleStepError, VersionMismatchError
from swarm.protocol import (
    COMPUTE_REQUEST,
    PROTOCOL_VERSION,
    BackwardRequest,
    ErrorReply,
    ForwardRequest,
    InferenceRequest,
    InfoReply,
    Reply,
    StateRequest,
    StepNotice,
    check_version,
    parse_reply,
)
from swarm.records import SCHEMA_VERSION, Assignment, Lease, Placement, TrainerProgress, parse_as


def test_each_request_kind_round_trips_through_its_model():
    for request in (
        ForwardRequest(start=0, end=4, keep_for_backward=True, forward_id="f"),
        BackwardRequest(start=2, end=4, forward_id="f", input_grad=False),
        StateRequest(start=0, end=2),
        StepNotice(step=7),
    ):
        wire = request.model_dump(mode="json")
        assert wire["protocol_version"] == PROTOCOL_VERSION
        assert COMPUTE_REQUEST.validate_python(wire) == request


@pytest.mark.parametrize(
    "meta",
    [
        {"kind": "sideways", "start": 0, "end": 1},
        {"kind": "forward", "start": 0, "end": 1, "extras": {}},  # a field of protocol 1
        {"kind": "forward", "start": -1, "end": 1},
        {"kind": "step", "step": -3},
        {"kind": "release", "client": "short"},
        {"kind": "forward", "start": 0, "end": 1, "forward_id": "x" * 1000},
    ],
)
def test_malformed_requests_are_refused(meta):
    with pytest.raises(ValidationError):
        COMPUTE_REQUEST.validate_python({"protocol_version": PROTOCOL_VERSION, **meta})


def test_other_protocol_versions_are_refused_before_parsing():
    check_version({"protocol_version": PROTOCOL_VERSION})
    for version in (1, PROTOCOL_VERSION + 1, None, "2"):
        with pytest.raises(VersionMismatchError, match=f"speaks protocol {version}"):
            check_version({"protocol_version": version, "anything": "at all"})
    with pytest.raises(ValidationError):  # a session must open before it steps: both are typed
        InferenceRequest.model_validate({"protocol_version": PROTOCOL_VERSION, "open": {"session_id": ""}})


def test_error_replies_raise_the_named_class_with_typed_fields():
    stale = ErrorReply(code=StaleStepError.code, error="behind", server_step=12).model_dump(mode="json")
    with pytest.raises(StaleStepError) as info:
        parse_reply(stale, Reply, "peerX")
    assert info.value.server_step == 12 and info.value.peer_id == "peerX"
    with pytest.raises(BadInputError):
        parse_reply(ErrorReply(code="bad_input", error="no").model_dump(), Reply, "p")
    with pytest.raises(PeerUnavailableError):
        parse_reply(ErrorReply(code=PeerUnavailableError.code, error="gone").model_dump(), Reply, "p")
    info_reply = InfoReply(peer_id="p", model_id="m", fingerprint="f", stats={"forward": 2}).model_dump(mode="json")
    assert parse_reply(info_reply, InfoReply, "p").stats == {"forward": 2}
    with pytest.raises(ValidationError):
        parse_reply({"ok": True, "surprise": 1}, InfoReply, "p")


def test_dht_values_are_typed_records():
    lease = Lease(term=3, holder="a", expires=10.0)
    assert parse_as(Lease, lease.to_wire()) == lease
    assert parse_as(Lease, {"term": "nine", "holder": "a", "expires": 1, "schema_version": SCHEMA_VERSION}) is None
    assert parse_as(Lease, dict(lease.to_wire(), schema_version=SCHEMA_VERSION - 1)) is None
    plan = Assignment(term=1, broker="b", issued_at=0.0, placements={"p": Placement(start=0, end=2, role="serve")})
    assert parse_as(Assignment, plan.to_wire()) == plan
    bad = dict(plan.to_wire(), placements={"p": {"start": 0, "end": 2, "role": "boss", "schema_version": 2}})
    assert parse_as(Assignment, bad) is None
    progress = TrainerProgress(trainer="t", step=4, samples=16, updated=1.0)
    assert parse_as(TrainerProgress, progress.to_wire()) == progress
