"""Bad requests get a clear error; the server stays up and an open session of another caller is unharmed."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from swarm import wire
from swarm.errors import BadInputError, CacheFullError, SessionLengthError, VersionMismatchError
from swarm.hop import Hop
from swarm.protocol import PROTOCOL_VERSION, RPC_FORWARD, RPC_INFERENCE
from tests.helpers.models import local_reference
from tests.helpers.swarms import connect, counter, raw_call, running_swarm

HIDDEN = 64


@pytest.fixture(scope="module")
def server(tiny_models):
    folder = str(tiny_models["llama"])
    limits = ("--cache-tokens", "64", "--max-batch-tokens", "512")
    with running_swarm(folder, ["0:4"], *limits, "--metrics-port", "0") as swarm:  # metrics: what it counts
        yield swarm


@pytest.fixture(scope="module")
def guarded(tiny_models, server):
    client = connect(str(tiny_models["llama"]), server)
    try:
        yield client, local_reference(tiny_models["llama"])
    finally:
        client.close()


def _hop(client) -> Hop:
    client(torch.tensor([[1, 2]]))
    return client.route[0]


def _call(client, hop: Hop, meta: dict, tensors: dict):
    return raw_call(client, hop, dict({"protocol_version": PROTOCOL_VERSION}, **meta), tensors)


def _forward_meta(hop: Hop, **over) -> dict:
    return dict({"kind": "forward", "start": hop.start, "end": hop.end}, **over)


def test_bad_requests_get_clear_errors_and_harm_no_session(guarded):
    client, ref = guarded
    hop = _hop(client)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with client.inference_session(max_length=10) as session:
        with torch.no_grad():
            first = client(prompt).logits[:, -1]

        with pytest.raises(BadInputError, match=rf"must be \[batch, seq, {HIDDEN}\]"):
            _call(client, hop, _forward_meta(hop), {"hidden": torch.zeros(1, 3, HIDDEN + 1)})
        with pytest.raises(BadInputError, match="must be torch.float32"):
            _call(client, hop, _forward_meta(hop), {"hidden": torch.zeros(1, 3, HIDDEN, dtype=torch.float64)})
        with pytest.raises(BadInputError, match="unknown blocks 2:6: the model has 4 blocks"):
            _call(client, hop, _forward_meta(hop, start=2, end=6), {"hidden": torch.zeros(1, 3, HIDDEN)})
        with pytest.raises(BadInputError, match="exceeds 512"):
            _call(client, hop, _forward_meta(hop), {"hidden": torch.zeros(2, 300, HIDDEN)})
        with pytest.raises(BadInputError, match="attention_mask must be int64"):
            _call(
                client,
                hop,
                _forward_meta(hop),
                {"hidden": torch.zeros(1, 3, HIDDEN), "attention_mask": torch.ones(1, 5, dtype=torch.int64)},
            )
        with pytest.raises(BadInputError, match="malformed metadata"):
            _call(client, hop, _forward_meta(hop, kind="sideways"), {"hidden": torch.zeros(1, 3, HIDDEN)})

        # raw frames: garbage metadata, and peers of other protocol versions (a newer one, and this version's
        # predecessor with its own request format, as an old client sends it)
        conn = client.connection

        async def raw(frame):
            return wire.decode([await wire_call(conn, hop, frame)])[0]

        reply = conn.loop.run(raw(wire.Frame(metadata=b"\xc1not msgpack")))
        assert reply["ok"] is False and "malformed metadata" in reply["error"]
        reply = conn.loop.run(raw(wire.Frame(metadata=msgpack.packb({"_tensors": ["hidden"], "kind": "forward"}))))
        assert reply["ok"] is False  # names a tensor it does not carry
        with pytest.raises(VersionMismatchError, match=f"speaks protocol {PROTOCOL_VERSION + 1}"):
            raw_call(
                client,
                hop,
                {"protocol_version": PROTOCOL_VERSION + 1, **_forward_meta(hop)},
                {"hidden": torch.zeros(1, 2, HIDDEN)},
            )
        old = {
            "protocol_version": 1,
            "kind": "forward",
            "start": hop.start,
            "end": hop.end,
            "keep_for_backward": False,
            "forward_id": None,
            "adapter": None,
            "input_grad": True,
            "train": None,
            "extras": {},
        }
        with pytest.raises(VersionMismatchError, match=f"speaks protocol 1, this server speaks {PROTOCOL_VERSION}"):
            raw_call(client, hop, old, {"hidden": torch.zeros(1, 2, HIDDEN)})
        old_open = {
            "session_id": "s" * 32,
            "start": hop.start,
            "end": hop.end,
            "max_length": 8,
            "batch_size": 1,
            "adapter": None,
            "extras": {},
        }
        with pytest.raises(VersionMismatchError, match="speaks protocol 1"):
            raw_call(
                client,
                hop,
                {"protocol_version": 1, "open": old_open, "step": {"position": 0}},
                {"hidden": torch.zeros(1, 2, HIDDEN)},
                rpc=RPC_INFERENCE,
            )

        # the open session is unharmed
        with torch.no_grad():
            second = client(torch.tensor([[9]])).logits[:, -1]
        assert session.position == 6
    with torch.no_grad():
        expected = ref(torch.cat([prompt, torch.tensor([[9]])], dim=1)).logits
    assert (first - expected[:, 4]).abs().max() < 1e-4
    assert (second - expected[:, 5]).abs().max() < 1e-4


async def wire_call(conn, hop: Hop, frame: wire.Frame) -> wire.Frame:
    """One raw frame over libp2p's unary call, bypassing every check of the client library."""
    from hivemind.p2p import PeerID

    return await conn.remote.p2p.call_protobuf_handler(PeerID.from_base58(hop.peer_id), RPC_FORWARD, frame, wire.Frame)


def test_session_beyond_budget_or_length(guarded):
    client, _ = guarded
    with pytest.raises(CacheFullError, match="KV-cache room"):
        with client.inference_session(max_length=100):
            client(torch.tensor([[1, 2, 3]]))
    with client.inference_session(max_length=4):
        client(torch.tensor([[1, 2, 3]]))
        with pytest.raises(SessionLengthError, match="max_length 4"):
            client(torch.tensor([[1, 2]]))
    # still serving
    with torch.no_grad():
        assert client(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)


def test_backward_recomputes_when_the_server_dropped_the_forward(guarded):
    from swarm.errors import ActivationsGoneError

    client, _ = guarded
    hop = _hop(client)
    torch.manual_seed(0)
    hidden, grad = torch.randn(1, 5, HIDDEN), torch.randn(1, 5, HIDDEN)
    _call(client, hop, _forward_meta(hop, keep_for_backward=True, forward_id="kept-1"), {"hidden": hidden})
    kept = _call(client, hop, dict(_forward_meta(hop), kind="backward", forward_id="kept-1"), {"grad_output": grad})
    with pytest.raises(ActivationsGoneError):
        _call(client, hop, dict(_forward_meta(hop), kind="backward", forward_id="never-kept"), {"grad_output": grad})
    again = _call(
        client,
        hop,
        dict(_forward_meta(hop), kind="backward", forward_id="never-kept"),
        {"grad_output": grad, "hidden": hidden},
    )
    assert torch.allclose(kept["grad_input"], again["grad_input"], atol=1e-6)


def test_bad_adapters_get_clear_errors_and_stay_private(guarded):
    from swarm.errors import AdapterMissingError

    client, ref = guarded
    hop = _hop(client)
    mine, other = "a" * 64, "b" * 64
    hidden = torch.randn(1, 3, HIDDEN)

    def forward(tensors: dict, client_id: str = mine, has_tensors: bool = True, version: int = 1):
        adapter = {"client": client_id, "version": version, "has_tensors": has_tensors, "scaling": 2.0}
        return _call(client, hop, _forward_meta(hop, adapter=adapter), dict(tensors, hidden=hidden))

    a, b = torch.randn(4, HIDDEN), torch.randn(HIDDEN, 4)
    with pytest.raises(BadInputError, match=r"must be A \[rank, 64\] and B \[64, rank\]"):
        forward({"lora.0.self_attn.q_proj.A": a, "lora.0.self_attn.q_proj.B": b[:-1]})
    with pytest.raises(BadInputError, match="no linear module 'self_attn.qkv'"):
        forward({"lora.0.self_attn.qkv.A": a, "lora.0.self_attn.qkv.B": b})
    with pytest.raises(BadInputError, match="lacks its B matrix"):
        forward({"lora.1.self_attn.q_proj.A": a})
    with pytest.raises(BadInputError, match="must be torch.float32"):
        forward({"lora.0.self_attn.q_proj.A": a.double(), "lora.0.self_attn.q_proj.B": b.double()})
    with pytest.raises(BadInputError, match="outside the requested blocks"):
        _call(
            client,
            hop,
            _forward_meta(hop, end=2, adapter={"client": mine, "version": 1, "has_tensors": True}),
            {"hidden": hidden, "lora.3.self_attn.q_proj.A": a, "lora.3.self_attn.q_proj.B": b},
        )
    with pytest.raises(BadInputError, match="malformed adapter tensor name"):
        forward({"lora.x.A": a})
    with pytest.raises(BadInputError, match="no adapter reference"):
        _call(client, hop, _forward_meta(hop), {"hidden": hidden, "deep.0": torch.zeros(2, HIDDEN)})
    with pytest.raises(BadInputError, match="malformed metadata"):
        forward({}, client_id="short")
    with pytest.raises(BadInputError, match="malformed metadata"):  # fields another version had are refused
        _call(client, hop, _forward_meta(hop, extras={"x": 1}), {"hidden": hidden})
    with pytest.raises(AdapterMissingError):
        forward({}, has_tensors=False)

    good = {"lora.0.self_attn.q_proj.A": a, "lora.0.self_attn.q_proj.B": b}
    with_adapter = forward(good)["hidden"]
    assert torch.equal(forward({}, has_tensors=False)["hidden"], with_adapter)  # the cached copy
    plain = _call(client, hop, _forward_meta(hop), {"hidden": hidden})["hidden"]
    assert not torch.allclose(plain, with_adapter)
    with pytest.raises(AdapterMissingError):  # another client cannot use it
        forward({}, client_id=other, has_tensors=False)
    with pytest.raises(AdapterMissingError):  # nor can a stale version
        forward({}, has_tensors=False, version=2)
    with torch.no_grad():  # still serving
        assert client(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)


def test_degenerate_tensors_are_refused(guarded):
    client, _ = guarded
    hop = _hop(client)
    for hidden, message in (
        (torch.zeros(0, 3, HIDDEN), "empty batch"),
        (torch.zeros(1, 0, HIDDEN), "no tokens"),
        (torch.full((1, 2, HIDDEN), float("nan")), "NaN or infinite"),
    ):
        with pytest.raises(BadInputError, match=message):
            _call(client, hop, _forward_meta(hop), {"hidden": hidden})
    grad = torch.zeros(1, 2, HIDDEN)
    grad[0, 1, 3] = float("inf")
    with pytest.raises(BadInputError, match="grad_output holds NaN or infinite"):
        _call(client, hop, dict(_forward_meta(hop), kind="backward"), {"grad_output": grad, "hidden": grad * 0})
    with pytest.raises(BadInputError, match="does not take: \\['zzz'\\]"):
        _call(client, hop, _forward_meta(hop), {"hidden": torch.zeros(1, 2, HIDDEN), "zzz": torch.zeros(3)})
    with pytest.raises(BadInputError, match="position_ids must lie in"):
        _call(
            client,
            hop,
            _forward_meta(hop),
            {"hidden": torch.zeros(1, 2, HIDDEN), "position_ids": torch.tensor([[-5, 0]])},
        )


def test_idle_session_loses_its_room_and_its_client_hears_why(guarded, server):
    """Two identities (the client's own key and a fresh one, both over the direct plane, where the server tells
    them apart by their signed handshakes), each holding half the cache (its whole share, the default
    --caller-cache-share 0.5 of 64 tokens). The first goes quiet: the server ends its session, so the same identity
    can open another in that room, and the stream's next step hears SessionExpiredError."""
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.config import Timing
    from swarm.errors import BusyError, SessionExpiredError
    from swarm.identity import Credentials
    from swarm.protocol import InferenceRequest, InferenceStep, OpenSession
    from swarm.rpc.remote import Remote
    from swarm.rpc.stream import open_session

    client, _ = guarded
    hop = _hop(client)
    conn = client.connection
    timing = Timing.for_tests()
    ids = iter(range(1000))
    expired = counter(server, "swarm_peer_sessions_expired")[hop.peer_id]

    async def opened(remote: Remote, max_length: int):
        stream = await open_session(remote, hop, timing.open_timeout)
        request = InferenceRequest(
            open=OpenSession(
                session_id=f"idle-{next(ids)}", start=hop.start, end=hop.end, max_length=max_length, batch_size=1
            )
        )
        try:
            await stream.exchange(request, {}, timing.request_timeout)
        except Exception:
            stream.close()
            raise
        return stream

    async def scenario() -> None:
        mine = Remote(conn.remote.p2p, conn.remote.creds, direct="always")
        other = Remote(conn.remote.p2p, Credentials.of(RSAPrivateKey()), direct="always")
        streams = []
        try:
            streams.append(quiet := await opened(mine, 32))
            streams.append(await opened(other, 32))
            with pytest.raises(BusyError, match="share of this server's KV cache"):
                await opened(mine, 32)
            deadline = asyncio.get_running_loop().time() + timing.session_idle + 60.0  # bounds a hang
            while True:  # polled, not slept: the outcome is asserted, never a duration
                try:
                    streams.append(await opened(mine, 32))  # the quiet session's room, given back
                    break
                except BusyError:
                    assert asyncio.get_running_loop().time() < deadline, "the idle session kept its room"
                    await asyncio.sleep(0.5)
            step = InferenceRequest(step=InferenceStep(position=0))
            with pytest.raises(SessionExpiredError, match="idle for .* reopen the session"):
                await quiet.exchange(step, {"hidden": torch.zeros(1, 1, HIDDEN)}, timing.request_timeout)
        finally:
            for stream in streams:
                stream.close()
            other.close()

    conn.loop.run(scenario())
    assert counter(server, "swarm_peer_sessions_expired")[hop.peer_id] >= expired + 1  # the server counted it
    with torch.no_grad():  # still serving
        assert client(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)
