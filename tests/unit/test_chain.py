"""Chaining's pure parts: routes a server accepts, commitments a client believes, pieces of a long step, and the
wait of a push that arrived before its route."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from peers.rpc.chain import accept_route
from peers.serving.checks import Limits
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget
from peers.serving.sessions import Session, SessionTable
from swarm.client.session.steps import chunks
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.identity import Credentials, Signed, sign_record
from swarm.ids import Span
from swarm.protocol import ChainHop, ChainRoute, StepReply
from swarm.rpc.commit import ChainCopy, CommitKey, CommitSigner, digest


@pytest.fixture(scope="module")
def keys() -> tuple[Credentials, Credentials, Credentials]:
    return tuple(Credentials.of(RSAPrivateKey()) for _ in range(3))  # type: ignore[return-value]


def signed(creds: Credentials, route: ChainRoute) -> Signed:
    payload = route.model_dump_json()
    return Signed(public_key=creds.public_key, payload=payload, signature=creds.sign(payload.encode()))


def session(sid: str = "s1") -> Session:
    return Session(sid, Span(0, 2), 64, 1, None, 64, caller="")


def test_a_route_binds_only_when_its_owner_signed_it_and_it_names_this_session(keys):
    client, server, other = keys
    hops = (ChainHop(peer_id=other.peer_id, session_id="s0"), ChainHop(peer_id=server.peer_id, session_id="s1"))
    route = ChainRoute(client=client.peer_id, generation=3, hops=hops)
    s = session()
    accept_route(s, signed(client, route), client.peer_id, server.peer_id)
    assert s.index == 1 and s.previous == other.peer_id
    with pytest.raises(BadInputError, match="another client"):  # a valid signature, of someone else's route
        accept_route(
            session(), signed(other, route.model_copy(update={"client": other.peer_id})), client.peer_id, server.peer_id
        )
    with pytest.raises(BadInputError, match="signed by"):  # the owner's name, another's key
        accept_route(session(), signed(other, route), client.peer_id, server.peer_id)
    with pytest.raises(BadInputError, match="exactly once"):
        accept_route(session("s9"), signed(client, route), client.peer_id, server.peer_id)
    twice = route.model_copy(update={"hops": (*hops, hops[1])})
    with pytest.raises(BadInputError, match="exactly once"):
        accept_route(session(), signed(client, twice), client.peer_id, server.peer_id)
    with pytest.raises(BadInputError, match="older"):  # a route never goes back to an older generation
        accept_route(s, signed(client, route.model_copy(update={"generation": 2})), client.peer_id, server.peer_id)
    forged = signed(client, route).model_copy(
        update={"payload": route.model_copy(update={"generation": 9}).model_dump_json()}
    )
    with pytest.raises(BadInputError, match="signature"):
        accept_route(session(), forged, client.peer_id, server.peer_id)


def test_a_route_of_dozens_of_hops_with_their_addresses_is_signed_and_bound(keys):
    """48 hops of one block each (a swarm of small GPUs), each with its session, direct address and two libp2p
    addresses: the client's signed route carries them all (4 KiB held 13 hops of this size)."""
    client, server, _ = keys
    maddrs = (f"/ip4/203.0.113.7/tcp/31337/p2p/{server.peer_id}", f"/ip6/2001:db8::7/tcp/31337/p2p/{server.peer_id}")
    hops = tuple(
        ChainHop(
            peer_id=f"{server.peer_id[:-2]}{k:02d}", session_id=f"{k:032x}", direct="203.0.113.7:40000", maddrs=maddrs
        )
        for k in range(47)
    ) + (ChainHop(peer_id=server.peer_id, session_id="s1", direct="203.0.113.7:40000", maddrs=maddrs),)
    route = ChainRoute(client=client.peer_id, generation=0, hops=hops)
    s = session()
    accept_route(s, sign_record(client.key, route), client.peer_id, server.peer_id)
    assert s.index == 47 and len(route.model_dump_json()) > 3 * 4096


def test_commitments_are_believed_only_under_a_certified_key(keys):
    client, server, other = keys
    signer = CommitSigner(server, sign_every=2)
    x, y = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    first = signer.reply(("c", "s1"), 5, 2, x, y)
    assert first.input_digest == digest(x) and first.digest == digest(y)
    assert first.signature == ""  # the chain's head is signed every second step here
    second = signer.reply(("c", "s1"), 8, 2, y, x)
    assert second.signature
    key = CommitKey(signer.opening, server.peer_id)

    def audited(*replies: StepReply, session_id: str = "s1") -> bool:
        copy = ChainCopy(session_id)
        for reply in replies:
            copy.fold(reply)
        return copy.audit(key)

    assert audited(first, second)
    # the one signature covers both commitments: changing either, in any field, breaks it
    for change in ({"digest": "0" * 64}, {"input_digest": "0" * 64}, {"position": 6}, {"tag": 3}):
        assert not audited(first.model_copy(update=change), second)
        assert not audited(first, second.model_copy(update=change))
    assert not audited(second, first)  # nor can they be reordered
    assert not audited(first, second, session_id="s2")  # or moved to another session
    assert not audited(first, second.model_copy(update={"signature": "00" * 64}))
    assert not audited(first, second.model_copy(update={"signature": "zz"}))
    with pytest.raises(BadInputError, match="not certified"):  # another peer's certificate
        CommitKey(signer.opening, other.peer_id)
    stolen = CommitSigner(other).opening.model_copy(update={"public_key": server.public_key})
    with pytest.raises(BadInputError, match="not certified"):  # a key certified by someone else, in its name
        CommitKey(stolen, server.peer_id)


def test_a_seal_signs_the_steps_since_the_last_signature(keys):
    _, server, _ = keys
    signer = CommitSigner(server, sign_every=8)
    key = CommitKey(signer.opening, server.peer_id)
    x = torch.randn(1, 1, 8)
    assert signer.sealed(("c", "s1")).chain_signature == ""  # an opening: nothing to sign yet
    copy = ChainCopy("s1")
    for position in range(3):
        copy.fold(signer.reply(("c", "s1"), position, 1, x, x))
    assert copy.signed_length == 0 and copy.audit(key)  # nothing signed, nothing to check yet
    sealed = signer.sealed(("c", "s1"))
    assert sealed.chain_length == 3
    assert copy.seal(sealed) and copy.signed_length == 3 and copy.audit(key) and copy.verified == 3
    assert not ChainCopy("s1").seal(sealed)  # a seal of a chain of another length than the copy's
    forged = ChainCopy("s1")
    for position in (0, 1, 9):
        forged.fold(signer.reply(("c", "other"), position, 1, x, x))
    assert forged.seal(sealed) and not forged.audit(key)  # the right length, not the commitments it signed
    signer.end(("c", "s1"))
    assert signer.sealed(("c", "s1")).chain_length == 0  # a session that ended is forgotten


def test_digests_see_every_byte_and_the_dtype():
    x = torch.zeros(2, 4)
    assert digest(x) == digest(x.clone()) != digest(x.to(torch.float16))
    y = x.clone()
    y[1, 3] = 1e-30
    assert digest(y) != digest(x)


def test_a_long_step_goes_in_pieces():
    assert chunks(5, 128) == [chunks(5, 128)[0]] and chunks(5, 128)[0].end == 5
    pieces = chunks(300, 128)
    assert [(c.start, c.end) for c in pieces] == [(0, 128), (128, 256), (256, 300)]
    assert len(chunks(300, 0)) == 1


def test_a_push_waits_for_its_session_and_route_then_gives_up():
    async def main() -> None:
        engine = Engine(Limits(8, torch.float32, 2, 64), ComputeConfig(), Timing())
        sessions = SessionTable(engine, CacheBudget(100, per_caller=100), cache_wait=0.1)
        with pytest.raises(BadInputError, match="no session"):
            await sessions.wait_for("client", "s1", 0, 0.05)
        s = session()
        s.caller = "client"

        async def later() -> None:  # each sleep(0) lets the waiter run into its wait (no timer involved)
            await asyncio.sleep(0)
            sessions.open[("client", "s1")] = s
            await sessions.notify()  # opened, but without a route yet: still waiting
            await asyncio.sleep(0)
            assert not waiter.done()
            s.route = ChainRoute(client="client", generation=1, hops=(ChainHop(peer_id="p", session_id="s1"),))
            await sessions.notify()

        waiter = asyncio.create_task(sessions.wait_for("client", "s1", 1, 60.0))  # a bound on a hang only
        await later()
        assert await waiter is s
        with pytest.raises(BadInputError):  # a newer generation than the route it has
            await sessions.wait_for("client", "s1", 2, 0.05)

    asyncio.run(main())
