"""The typed messages: every request kind parses into its own model, anything else is refused, another protocol
version is refused before parsing, and error replies carry typed fields (a stale step's server step)."""

from __future__ import annotations

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from swarm.errors import BadInputError, PeerUnavailableError, StaleStepError, VersionMismatchError
from swarm.identity import open_signed, peer_id_of_key, sign_record
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


def _progress(key: RSAPrivateKey, **fields) -> TrainerProgress:
    me = peer_id_of_key(key.get_public_key().to_bytes())
    return TrainerProgress(**{"trainer": me, "step": 7, "samples": 0, "updated": 1.0, **fields})


def test_each_request_kind_round_trips_through_its_model():
    key = RSAPrivateKey()
    for request in (
        ForwardRequest(start=0, end=4, keep_for_backward=True, forward_id="f"),
        BackwardRequest(start=2, end=4, forward_id="f", input_grad=False),
        StateRequest(start=0, end=2, round=True),
        StepNotice(step=7, proof=sign_record(key, _progress(key))),
    ):
        wire = request.model_dump(mode="json")
        assert wire["protocol_version"] == PROTOCOL_VERSION
        assert COMPUTE_REQUEST.validate_python(wire) == request


def test_only_a_subkey_that_is_exactly_one_owner_marker_names_an_author():
    from hivemind.dht.crypto import RSASignatureValidator

    from swarm.identity import owner_of

    victim, attacker = RSAPrivateKey(), RSAPrivateKey()
    marker = RSASignatureValidator(victim).local_public_key
    assert owner_of(marker) == peer_id_of_key(victim.get_public_key().to_bytes())
    # hivemind would sign this with the attacker's key (the first marker it finds is the attacker's own)
    confusing = marker[:-1] + b"\n" + RSASignatureValidator(attacker).local_public_key
    for subkey in (confusing, marker + b" ", b"x" + marker, marker + marker, b"plain", "[owner:text]", None):
        assert owner_of(subkey) is None


def test_a_signed_record_opens_only_as_its_author_signed_it():
    key, other = RSAPrivateKey(), RSAPrivateKey()
    signed = sign_record(key, _progress(key))
    assert open_signed(signed, TrainerProgress) == _progress(key)
    tampered = signed.model_copy(update={"payload": signed.payload.replace('"step":7', '"step":999999')})
    with pytest.raises(BadInputError, match="signature does not match"):
        open_signed(tampered, TrainerProgress)
    with pytest.raises(BadInputError, match="signed by"):  # a valid signature, but on another peer's behalf
        open_signed(sign_record(other, _progress(key)), TrainerProgress)
    swapped = signed.model_copy(update={"public_key": other.get_public_key().to_bytes().decode()})
    with pytest.raises(BadInputError, match="signature does not match"):
        open_signed(swapped, TrainerProgress)
    with pytest.raises(BadInputError, match="unreadable key"):
        open_signed(signed.model_copy(update={"public_key": "ssh-rsa garbage"}), TrainerProgress)
    with pytest.raises(BadInputError, match="not a valid"):  # signed, but a number out of range
        open_signed(sign_record(key, _progress(key).model_copy(update={"step": -5})), TrainerProgress)


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
    lease = Lease(term=3, holder="a", start=0.0, expires=10.0)
    assert parse_as(Lease, lease.to_wire()) == lease
    assert parse_as(Lease, {"term": "nine", "holder": "a", "expires": 1, "schema_version": SCHEMA_VERSION}) is None
    assert parse_as(Lease, dict(lease.to_wire(), schema_version=SCHEMA_VERSION - 1)) is None
    plan = Assignment(term=1, broker="b", issued_at=0.0, placements={"p": Placement(start=0, end=2, role="serve")})
    assert parse_as(Assignment, plan.to_wire()) == plan
    bad = dict(plan.to_wire(), placements={"p": {"start": 0, "end": 2, "role": "boss"}})
    assert parse_as(Assignment, bad) is None
    progress = TrainerProgress(trainer="t", step=4, samples=16, updated=1.0)
    assert parse_as(TrainerProgress, progress.to_wire()) == progress
