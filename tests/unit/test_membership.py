"""Private swarms' key and DHT authorizer, on real hivemind DHT protobufs: members' requests and answers pass, a
tampered, foreign, replayed or stale request is refused, and so is an answer not signed by a member for that very
request. Membership tokens admit only the peer id they were made for."""

from __future__ import annotations

import asyncio
import stat
import time
from pathlib import Path

import pytest
from hivemind.proto import dht_pb2

from peers.config import NetworkConfig
from swarm.errors import BadInputError
from swarm.membership import SwarmKey, SwarmKeyAuthorizer, swarm_key_for
from swarm.serve import build_parser, config_from_args


def run(coro):  # the authorizer's methods are coroutines (hivemind awaits them in the DHT's loop)
    return asyncio.run(coro)


def signed(authorizer: SwarmKeyAuthorizer, request=None):
    request = request if request is not None else dht_pb2.FindRequest(keys=[b"k" * 20, b"j" * 20])
    run(authorizer.sign_request(request, None))
    return request


def copy(message):
    return type(message).FromString(message.SerializeToString())  # what the receiver parses off the wire


@pytest.fixture
def key(tmp_path: Path) -> SwarmKey:
    return SwarmKey.create(tmp_path / "swarm.key")


def test_create_writes_a_private_hex_file_that_loads_as_the_same_key(tmp_path: Path):
    path = tmp_path / "sub" / "swarm.key"
    key = SwarmKey.create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text().strip()
    assert len(text) == 64 and int(text, 16) >= 0
    assert SwarmKey.load(path) == key and len(key.secret) == 32
    assert key.secret.hex() not in repr(key)  # never in logs
    path.write_text(text + "\n\n")  # an editor's newline changes nothing
    assert SwarmKey.load(path).secret == key.secret
    with pytest.raises(BadInputError, match="already exists"):
        SwarmKey.create(path)


def test_load_refuses_a_missing_short_or_unreadable_file(tmp_path: Path):
    with pytest.raises(BadInputError, match="--swarm-key: no key file"):
        SwarmKey.load(tmp_path / "nope")
    (tmp_path / "short").write_text("0123456789abcdef")
    with pytest.raises(BadInputError, match="fewer than 32"):
        SwarmKey.load(tmp_path / "short")
    with pytest.raises(BadInputError, match="cannot read"):
        SwarmKey.load(tmp_path)


def test_only_a_new_swarm_creates_a_missing_key(tmp_path: Path):
    assert swarm_key_for(None) is None
    with pytest.raises(BadInputError, match="no key file"):
        swarm_key_for(tmp_path / "k")
    created = swarm_key_for(tmp_path / "k", new_swarm=True)
    assert created is not None and (tmp_path / "k").exists()
    assert swarm_key_for(tmp_path / "k", new_swarm=True) == swarm_key_for(tmp_path / "k") == created


def test_the_serve_flag_reaches_the_network_config():
    assert NetworkConfig().swarm_key is None
    cfg = config_from_args(build_parser().parse_args(["--new-swarm", "--swarm-key", "/tmp/x.key"]))
    assert cfg.network.swarm_key == Path("/tmp/x.key")


def test_tokens_admit_only_their_peer_under_the_same_key(key: SwarmKey, tmp_path: Path):
    other = SwarmKey.create(tmp_path / "other.key")
    token = key.token("QmAlice")
    assert key.admits("QmAlice", token) and SwarmKey.load(tmp_path / "swarm.key").admits("QmAlice", token)
    assert not key.admits("QmBob", token)
    assert not other.admits("QmAlice", token)
    assert not key.admits("QmAlice", "") and not key.admits("QmAlice", "é" * 64)  # hostile input: False, no error


def test_members_requests_and_answers_pass(key: SwarmKey):
    client, server = SwarmKeyAuthorizer(key), SwarmKeyAuthorizer(key)
    for request in (
        dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"n" * 20), validate=True),
        dht_pb2.StoreRequest(
            keys=[b"k" * 20], values=[b"v"], expiration_time=[time.time() + 9], subkeys=[b"s"], in_cache=[False]
        ),
        dht_pb2.FindRequest(keys=[b"k" * 20]),
    ):
        sent = copy(signed(client, request))
        assert run(server.validate_request(sent))
        response = dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=b"v")])
        run(server.sign_response(response, sent))
        assert run(client.validate_response(copy(response), request))


def test_tampered_foreign_replayed_and_stale_requests_are_refused(key: SwarmKey, tmp_path: Path, monkeypatch):
    server = SwarmKeyAuthorizer(key)
    tampered = copy(signed(SwarmKeyAuthorizer(key)))
    tampered.keys[0] = b"x" * 20
    assert not run(server.validate_request(tampered))

    foreign = copy(signed(SwarmKeyAuthorizer(SwarmKey.create(tmp_path / "other.key"))))
    assert not run(server.validate_request(foreign))
    assert not run(server.validate_request(dht_pb2.FindRequest(keys=[b"k" * 20])))  # an outsider: no auth at all

    request = signed(SwarmKeyAuthorizer(key))
    assert run(server.validate_request(copy(request)))
    assert not run(server.validate_request(copy(request)))  # the same nonce again

    strict = SwarmKeyAuthorizer(key, max_skew=0.2)
    now = time.time()
    monkeypatch.setattr("swarm.membership.get_dht_time", lambda: now - 0.4)  # signed 0.4 s ago, by its own clock
    late = signed(SwarmKeyAuthorizer(key))
    monkeypatch.setattr("swarm.membership.get_dht_time", lambda: now)
    assert not run(strict.validate_request(copy(late)))
    assert run(SwarmKeyAuthorizer(key, max_skew=1.0).validate_request(copy(late)))  # within a looser bound


def test_a_replay_is_refused_even_after_its_nonce_was_evicted(key: SwarmKey):
    server = SwarmKeyAuthorizer(key, max_nonces=3)
    requests = [signed(SwarmKeyAuthorizer(key)) for _ in range(6)]
    assert all(run(server.validate_request(copy(r))) for r in requests)
    assert len(server._nonces) == 3
    assert not any(run(server.validate_request(copy(r))) for r in requests)  # forgotten or not, all refused
    assert run(server.validate_request(copy(signed(SwarmKeyAuthorizer(key)))))  # a new request still passes


def test_answers_must_be_a_members_and_for_this_request(key: SwarmKey, tmp_path: Path):
    client, server = SwarmKeyAuthorizer(key), SwarmKeyAuthorizer(key)
    request, other_request = signed(client), signed(client)
    response = dht_pb2.FindResponse()
    run(server.sign_response(response, other_request))
    assert not run(client.validate_response(copy(response), request))  # an answer to another question

    foreign = dht_pb2.FindResponse()
    run(SwarmKeyAuthorizer(SwarmKey.create(tmp_path / "other.key")).sign_response(foreign, request))
    assert not run(client.validate_response(copy(foreign), request))

    tampered = dht_pb2.FindResponse()
    run(server.sign_response(tampered, request))
    tampered.results.add(type=dht_pb2.FOUND_REGULAR, value=b"forged")
    assert not run(client.validate_response(copy(tampered), request))

    assert client.unsigned_answers == 0
    assert not run(client.validate_response(dht_pb2.FindResponse(), request))  # an open swarm's peer answers
    assert client.unsigned_answers == 1

    signature = copy(request).auth.signature  # a request's signature is no response's
    posing = dht_pb2.FindResponse()
    posing.auth.nonce, posing.auth.signature = request.auth.nonce, signature
    assert not run(client.validate_response(posing, request))
