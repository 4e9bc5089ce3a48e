"""Prefix claims (``swarm.rpc.claims``): a session's first positions named by the digest of a prefix the server kept,
sent as pieces without tensors, through the real session table and a tiny Llama's span; they answer what a fresh
computation answers, only for the caller (and scope) that computed them, and anything else is refused; a claimed
piece's commitment binds the claimed inputs, so evidence built on it checks, and with other inputs does not."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from peers.serving.prefixes import PICKS
from peers.serving.sessions import SessionTable
from swarm.client.prefix_memory import MISS_BACKOFF, PrefixMemory
from swarm.errors import BadInputError, PrefixUnknownError
from swarm.identity import Credentials
from swarm.ids import Span
from swarm.protocol import PrefixClaim, PrefixUse
from swarm.rpc.claims import BLOCK, block_digests, claim_aux, input_digest, piece_digest
from swarm.rpc.commit import CommitSigner, binding
from swarm.rpc.evidence import build, check
from tests.helpers.prefix_table import ASKS, HIDDEN, fresh, inputs, opening, run, session_table, tiny_span


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return tiny_span(tmp_path_factory)


def _claim(hidden: torch.Tensor, length: int, end: int | None = None) -> PrefixClaim:
    chain = block_digests(b"", hidden[:, :length])
    return PrefixClaim(length=length, digest=chain[-1].hex(), end=end or length)


async def _claiming(table: SessionTable, caller: str, sid: str, hidden: torch.Tensor, length: int, scope=ASKS):
    """A session that claims ``hidden``'s first ``length`` positions in pieces of ``BLOCK``, then sends the rest."""
    session = await table.start(opening(sid, prefix=scope), {}, caller)
    outs, reused = [], []
    try:
        for at in range(0, length, BLOCK):
            claim = _claim(hidden, length, at + BLOCK)
            outs.append((await table.step(session, at, {}, claim))["hidden"])
            reused.append(session.reused)
        outs.append((await table.step(session, length, {"hidden": hidden[:, length:]}))["hidden"])
        reused.append(session.reused)
    finally:
        await table.end(session)
    return torch.cat(outs, dim=1), reused


async def test_claimed_pieces_answer_as_a_fresh_computation_and_the_session_is_kept_again(backend):
    table = session_table(backend)
    first = inputs(3 * BLOCK + 10)
    await run(table, "me", "a", first)
    later = torch.cat([first[:, : 2 * BLOCK + 5], inputs(40, seed=1)], dim=1)
    out, reused = await _claiming(table, "me", "b", later, 2 * BLOCK)
    assert reused == [BLOCK, BLOCK, 0]  # (the rest's first block differs from what was kept)
    assert torch.allclose(out, fresh(backend, later), atol=1e-5)
    # what the claiming session held is kept in turn: its own inputs, found by their digests
    out, reused = await run(table, "me", "c", later)
    assert reused == [2 * BLOCK] and torch.allclose(out, fresh(backend, later), atol=1e-5)


async def test_a_claim_of_what_the_server_does_not_hold_for_the_caller_is_refused(backend):
    table = session_table(backend)
    hidden = inputs(2 * BLOCK + 3)
    await run(table, "me", "a", hidden)
    nudged = hidden.clone()
    nudged[0, 3, 5] += 1e-6
    refused = [
        ("other", "b", hidden, 2 * BLOCK, ASKS),  # another identity
        ("me", "c", hidden, 2 * BLOCK, PrefixUse(scope="key-2")),  # another scope of the same identity
        ("me", "d", nudged, 2 * BLOCK, ASKS),  # other inputs: another chain of digests
    ]
    for caller, sid, x, length, scope in refused:
        with pytest.raises(PrefixUnknownError):
            await _claiming(table, caller, sid, x, length, scope)
    with pytest.raises(PrefixUnknownError):  # a session that did not ask for prefix caching
        await _claiming(table, "me", "f", hidden, 2 * BLOCK, None)
    out, reused = await _claiming(table, "me", "g", hidden, 2 * BLOCK)  # still there, for its caller
    assert reused == [BLOCK, BLOCK, 0] and torch.allclose(out, fresh(backend, hidden), atol=1e-5)
    out, reused = await _claiming(table, "me", "h", hidden, BLOCK)  # and its first block alone
    assert reused == [BLOCK, BLOCK] and torch.allclose(out, fresh(backend, hidden), atol=1e-5)


async def test_malformed_claims_are_bad_input(backend):
    table = session_table(backend)
    hidden = inputs(2 * BLOCK + 3)
    await run(table, "me", "a", hidden)
    claim = _claim(hidden, 2 * BLOCK, BLOCK)
    session = await table.start(opening("b", prefix=ASKS), {}, "me")
    with pytest.raises(BadInputError, match="no tensors"):
        await table.step(session, 0, {"hidden": hidden[:, :BLOCK]}, claim)
    with pytest.raises(BadInputError, match="out of order"):  # not begun at 0
        await table.step(session, BLOCK, {}, claim.model_copy(update={"end": 2 * BLOCK}))
    with pytest.raises(BadInputError, match="malformed"):  # a piece past the claim
        await table.step(session, 0, {}, claim.model_copy(update={"end": 3 * BLOCK}))
    await table.step(session, 0, {}, claim)
    with pytest.raises(BadInputError, match="first positions"):  # the first piece again
        await table.step(session, 0, {}, claim)
    with pytest.raises(BadInputError, match="out of order"):  # a piece that skips one
        await table.step(session, BLOCK + 1, {}, claim.model_copy(update={"end": 2 * BLOCK}))
    await table.end(session)
    stepped = await table.start(opening("c", prefix=ASKS), {}, "me")
    await table.step(stepped, 0, {"hidden": hidden[:, :5]})
    with pytest.raises(BadInputError, match="first positions"):  # a session that has stepped already
        await table.step(stepped, 0, {}, claim)
    await table.end(stepped)


def test_a_claimed_piece_s_commitment_binds_the_claimedinputs():
    server = Credentials.of(RSAPrivateKey())
    bound = binding(0, 4, False)
    signer = CommitSigner(server, sign_every=1000)
    key = ("client", "sid")
    g = torch.Generator().manual_seed(4)
    context = torch.randn(1, 2 * BLOCK + 3, 8, generator=g)
    outs = context * 2
    chain_end = block_digests(b"", context[:, : 2 * BLOCK])[-1]
    aux = claim_aux(2 * BLOCK)
    replies = [  # two claimed pieces, then the rest sent as one step, then a decode step
        signer.reply(key, 0, 1, piece_digest(chain_end, 0, BLOCK), outs[:, :BLOCK], bound, aux),
        signer.reply(key, BLOCK, 1, piece_digest(chain_end, BLOCK, 2 * BLOCK), outs[:, BLOCK : 2 * BLOCK], bound, aux),
        signer.reply(key, 2 * BLOCK, 1, context[:, 2 * BLOCK : -1], outs[:, 2 * BLOCK : -1], bound),
        signer.reply(key, 2 * BLOCK + 2, 1, context[:, -1:], outs[:, -1:], bound),
    ]
    assert input_digest(context, BLOCK, context[:, BLOCK : 2 * BLOCK], aux) == replies[1].input_digest
    sealed = signer.sealed(key, bound)
    kwargs = dict(session_id="sid", opening=sealed, chain=replies, signature=sealed.chain_signature, bad=2 * BLOCK + 2)
    evidence = build(context=context, output=outs[:, -1:], **kwargs)
    assert evidence is not None
    facts = check(evidence, server.peer_id, 0, 4)
    assert facts.offset == 2 * BLOCK + 2 and torch.equal(facts.inputs, context)
    other = context.clone()
    other[0, 7, 1] += 1.0  # another value inside the claimed positions: the claim's digest does not bind it
    assert build(context=other, output=outs[:, -1:], **kwargs) is None
    forged = evidence.model_copy(update={"inputs": type(evidence.inputs).of(other)})
    with pytest.raises(BadInputError, match="not what commitment 0 took in"):
        check(forged, server.peer_id, 0, 4)
    # a claimed piece's own output: bound where the context holds the whole claim, not where it ends before it
    last = build(context=context, output=outs[:, BLOCK : 2 * BLOCK], **{**kwargs, "bad": BLOCK})
    assert last is not None and check(last, server.peer_id, 0, 4).offset == BLOCK
    assert build(context=context, output=outs[:, :BLOCK], **{**kwargs, "bad": 0}) is None


def test_the_client_s_memory_is_bounded_and_leaves_a_refusing_server_alone_a_while():
    now = [0.0]
    memory = PrefixMemory(limit=4, clock=lambda: now[0])
    key, other = ("peer", 0, 4, "float32", "", False), ("peer2", 0, 4, "float32", "", False)
    chain = [bytes([i]) * 32 for i in range(3)]
    memory.remember(key, chain)
    assert memory.has(key) and memory.longest(key, chain) == 3 and memory.longest(key, chain[:1] + [b"x" * 32]) == 1
    memory.remember(other, [b"y" * 32, b"z" * 32])  # over the limit: the least recently used goes (block 2's)
    assert memory.longest(key, chain[:2]) == 1 and memory.longest(other, [b"y" * 32, b"z" * 32]) == 2
    for backoff in (MISS_BACKOFF, 2 * MISS_BACKOFF):
        memory.refused(key)
        memory.remember(key, chain)
        assert not memory.has(key)
        now[0] += backoff - 1
        assert not memory.has(key)
        now[0] += 1
        memory.remember(key, chain)
        assert memory.has(key)
    memory.honoured(key)  # answered: the next refusal starts over
    memory.refused(key)
    now[0] += MISS_BACKOFF
    memory.remember(key, chain)
    assert memory.has(key) and memory.has(other)


async def test_a_caller_s_next_session_reuses_its_kept_prefix_at_the_edge_of_its_share(backend):
    """The kept prefix and a new session of its caller do not fit the caller's share together: the prefix stands
    while the session reuses it (piece by piece, or claimed), and the caller is back within its share after the
    session's first step that reuses nothing (``PrefixStore.settle``)."""
    probe = session_table(backend)
    one = probe.prefix_cost(Span(0, 4), 1, 2 * BLOCK)
    trail = (2 * (2 * BLOCK + 3) + 2 * PICKS) * HIDDEN * 4  # a trail after 131 positions
    session_cost = probe.session_cost(opening("x", 512))
    share = session_cost + 2 * trail  # room for the session and its trail (whose outputs' room grows by doubling)
    assert session_cost + one > share
    table = session_table(backend, share=share)
    hidden = inputs(2 * BLOCK + 3)
    await run(table, "me", "a", hidden)
    session = await table.start(opening("b", prefix=ASKS), {}, "me")
    outs, reused = [], []
    for at, end in ((0, BLOCK), (BLOCK, 2 * BLOCK + 2), (2 * BLOCK + 2, 2 * BLOCK + 3)):  # pieces, then a decode step
        outs.append((await table.step(session, at, {"hidden": hidden[:, at:end]}))["hidden"])
        reused.append(session.reused)
        if end < 2 * BLOCK:
            assert table.budget.held["me"] > share  # the prefix stands beside the session while it reuses it
    assert reused == [BLOCK, BLOCK, 0] and table.budget.held["me"] <= share
    assert torch.allclose(torch.cat(outs, dim=1), fresh(backend, hidden), atol=1e-5)
    await table.end(session)
    out, reused = await _claiming(table, "me", "c", hidden, 2 * BLOCK)
    assert reused == [BLOCK, BLOCK, 0] and torch.allclose(out, fresh(backend, hidden), atol=1e-5)
    assert table.budget.held["me"] <= share
