"""Prefix caching on a server (``peers.serving.prefixes``), through the real session table and a tiny Llama's span:
a session that starts with a finished session's inputs reuses its whole blocks and answers what a fresh computation
answers; only the same caller and scope find them (sharing needs both sides); other inputs, a step with padding, a
redone step and other weights are never served from a stale entry; kept prefixes count in the KV budget, within the
caller's share, and give way to new sessions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.blocks.backend import SpanBackend
from peers.serving import prefixes
from peers.serving.kv_cache import CacheBudget
from peers.serving.prefixes import PICKS, PrefixStore, Trail
from swarm.ids import Span
from swarm.protocol import PrefixUse
from swarm.rpc.claims import BLOCK, block_digests
from tests.helpers.prefix_table import ASKS, HIDDEN, fresh, inputs, opening, run, session_table, tiny_span


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> SpanBackend:
    return tiny_span(tmp_path_factory)


async def test_a_session_that_starts_alike_reuses_whole_blocks_and_answers_as_a_fresh_one(backend):
    table = session_table(backend)
    first = inputs(3 * BLOCK + 10)
    out, reused = await run(table, "me", "a", first, steps=(70, 71))  # a prefill, one decode step, the rest
    assert reused == [0, 0, 0]
    assert torch.allclose(out, fresh(backend, first), atol=1e-5)
    second = torch.cat([first[:, : 2 * BLOCK + 5], inputs(40, seed=1)], dim=1)  # the same first 133 positions
    out, reused = await run(table, "me", "b", second, steps=(150,))
    assert reused == [2 * BLOCK, 0]  # whole blocks only, and only on the first step
    assert torch.allclose(out, fresh(backend, second), atol=1e-5)
    assert table.metrics.prefix_reused == 2 * BLOCK
    # the whole of the first session again: everything but the last position comes from the kept prefix
    out, reused = await run(table, "me", "c", first)
    assert reused == [3 * BLOCK] and torch.allclose(out, fresh(backend, first), atol=1e-5)
    # a prompt in pieces (a chained prefill): each piece goes on from where the kept prefix's blocks match
    out, reused = await run(table, "me", "d", first, steps=(100, 200))
    assert reused == [BLOCK, 3 * BLOCK - 100, 0]
    assert torch.allclose(out, fresh(backend, first), atol=1e-5)


def test_a_kept_prefix_is_copied_into_room_a_step_made(backend):
    """A session's cache room is made by its steps, in inference mode on the compute thread, and grown ahead; a kept
    prefix copied into room already there (an API's kept conversation going on) is written in place. It failed: an
    in-place write to an inference tensor outside inference mode."""
    x = inputs(100)
    kept, session = backend.new_cache(512), backend.new_cache(512)
    with torch.inference_mode():
        backend.run(x, Span(0, 4), cache=kept, past=0)
        backend.run(x, Span(0, 4), cache=session, past=0)  # room for 125 positions
    prefixes.crop_to(session, 10)
    prefixes.copy_prefix(kept, session, 10, 60)
    for mine, theirs in zip(session.layers, kept.layers, strict=True):
        assert mine.get_seq_length() == 60 and torch.equal(mine.keys, theirs.keys[..., :60, :])


async def test_only_the_same_caller_and_scope_find_a_prefix_and_sharing_takes_both_sides(backend):
    hidden = inputs(2 * BLOCK + 3)
    table = session_table(backend)
    await run(table, "me", "a", hidden)
    assert (await run(table, "other", "b", hidden))[1] == [0]  # another identity
    assert (await run(table, "me", "c", hidden, PrefixUse(scope="key-2")))[1] == [0]  # another API key's scope
    assert (await run(table, "me", "d", hidden, None))[1] == [0]  # a session that did not ask
    assert (await run(table, "me", "e", hidden))[1] == [2 * BLOCK]
    # sharing: a server that does not allow it keeps a sharing session's prefix private
    await run(table, "sharer", "f", hidden, PrefixUse(share=True))
    assert (await run(table, "taker", "g", hidden, PrefixUse(share=True)))[1] == [0]
    shared = session_table(backend, sharing=True)
    await run(shared, "sharer", "h", hidden, PrefixUse(share=True))
    assert (await run(shared, "taker", "i", hidden))[1] == [0]  # the taker did not ask to share
    assert (await run(shared, "taker", "j", hidden, PrefixUse(share=True)))[1] == [2 * BLOCK]


async def test_other_inputs_padding_and_redone_steps_never_reuse_what_does_not_match(backend):
    table = session_table(backend)
    hidden = inputs(2 * BLOCK + 3)
    await run(table, "me", "a", hidden)
    nudged = hidden.clone()
    nudged[0, 3, 5] += 1e-6  # one value of the first block
    out, reused = await run(table, "me", "b", nudged)
    assert reused == [0] and torch.allclose(out, fresh(backend, nudged), atol=1e-5)
    # a step with a padding mask is neither looked up nor kept
    padded = session_table(backend)
    session = await padded.start(opening("p", prefix=PrefixUse()), {}, "me")
    mask = torch.ones(1, hidden.shape[1], dtype=torch.int64)
    mask[0, 0] = 0
    await padded.step(session, 0, {"hidden": hidden, "attention_mask": mask})
    await padded.end(session)
    assert not padded.prefixes.entries
    # a step sent again from inside the last one (a speculative take-back) is hashed again: the kept digests are
    # those of what the session holds in the end
    redo = session_table(backend)
    session = await redo.start(opening("r", prefix=PrefixUse()), {}, "me")
    await redo.step(session, 0, {"hidden": hidden[:, :100]})
    drafts = inputs(60, seed=5)
    await redo.step(session, 100, {"hidden": drafts})  # drafts, taken back from 110 by the next step
    await redo.step(session, 110, {"hidden": hidden[:, 110:]})
    await redo.end(session)
    (entry,) = redo.prefixes.entries.values()
    held = torch.cat([hidden[:, :100], drafts[:, :10], hidden[:, 110:]], dim=1)
    assert entry.digests == block_digests(b"", held) != block_digests(b"", hidden)
    assert (await run(redo, "me", "s", hidden))[1] == [BLOCK]  # the first block only is the same
    assert (await run(redo, "me", "t", held))[1] == [2 * BLOCK]


def test_a_trail_records_the_digests_of_its_inputs_whatever_the_steps():
    hidden, out = inputs(5 * BLOCK + 7), inputs(5 * BLOCK + 7, seed=3)
    trail = Trail()
    at = 0
    for end in (1, 64, 65, 200, 201, 202, 5 * BLOCK + 7):
        seen = trail.ahead(at, hidden[:, at:end])
        assert seen is not None
        trail.record(at, out[:, at:end], seen)
        at = end
    assert trail.digests == block_digests(b"", hidden) and len(trail.digests) == 5
    assert all(torch.equal(trail.samples[b], hidden[:, b * BLOCK + trail.picks]) for b in range(5))
    assert trail.outputs is not None and torch.equal(trail.outputs[:, : trail.held], out)
    assert trail.ahead(100, hidden[:, 10:20]) is None  # before the last step's block: it cannot be hashed again
    assert trail.broken


async def test_kept_prefixes_count_in_the_budget_within_the_caller_s_share_and_give_way(backend):
    probe = session_table(backend)
    one = probe.prefix_cost(Span(0, 4), 1, 2 * BLOCK)  # what one kept prefix of two blocks takes
    # a session's trail after one step of 131: its outputs and inputs, and its blocks' sampled inputs
    trail = (2 * (2 * BLOCK + 3) + 2 * PICKS) * HIDDEN * 4
    session_cost = probe.session_cost(opening("x", 512))
    assert one > trail
    total = session_cost + trail + one + one // 2
    # a caller's session and its trail fit its share, not with its kept prefix too
    table = session_table(backend, total=total, share=session_cost + trail)
    await run(table, "me", "a", inputs(2 * BLOCK + 3, seed=1))
    assert table.budget.held["me"] == one == table.budget.used
    await run(table, "me", "b", inputs(2 * BLOCK + 3, seed=2))  # its session's room took its first prefix's
    assert [e.owner for e in table.prefixes.entries.values()] == ["me"] and table.budget.used == one
    await run(table, "you", "c", inputs(2 * BLOCK + 3, seed=3))  # room enough without evicting
    assert len(table.prefixes.entries) == 2 and table.budget.used == 2 * one
    assert table.budget.available == total
    # a new session that needs the room takes it from the least recently used
    session = await table.start(opening("d", 512, PrefixUse()), {}, "them")
    assert [e.owner for e in table.prefixes.entries.values()] == ["you"]
    await table.end(session)
    assert table.budget.used == one
    # a span this server no longer holds: its prefixes go at the next keep
    table.prefixes.purge(Span(4, 8))
    assert not table.prefixes.entries and table.budget.used == 0


async def test_a_session_s_trail_counts_as_it_grows_and_gives_way_to_a_new_session(backend):
    """A session that asks for prefix caching reserves what any other does (routing by announced free room holds);
    its trail (outputs and inputs to hash) is counted as its caller's as it grows, and a new session that needs the
    room breaks it: that session answers as before and is simply not kept."""
    probe = session_table(backend)
    session_cost = probe.session_cost(opening("x", 512))
    trail = (2 * (2 * BLOCK + 3) + 2 * PICKS) * HIDDEN * 4
    table = session_table(backend, total=2 * session_cost + trail - 1)
    hidden = inputs(2 * BLOCK + 3, seed=4)
    first = await table.start(opening("x", 512, ASKS), {}, "me")
    assert table.budget.used == session_cost  # nothing reserved for the trail
    out = (await table.step(first, 0, {"hidden": hidden}))["hidden"]
    assert table.prefixes is not None and table.prefixes.trail_bytes == trail
    assert table.budget.available == table.budget.total - session_cost  # announced as room a new session can have
    assert table.budget.held["me"] == session_cost + trail
    second = await table.start(opening("y", 512, ASKS), {}, "you")  # needs the trail's room: it breaks
    assert first.trail is not None and first.trail.broken and table.prefixes.trail_bytes == 0
    more = inputs(5, seed=5)
    out2 = (await table.step(first, hidden.shape[1], {"hidden": more}))["hidden"]
    assert torch.allclose(torch.cat([out, out2], dim=1), fresh(backend, torch.cat([hidden, more], dim=1)), atol=1e-5)
    await table.step(second, 0, {"hidden": hidden})  # no room for its trail either: it runs, and is not kept
    await table.end(first)
    await table.end(second)
    assert not table.prefixes.entries and table.budget.used == 0 and not table.budget.held


async def test_a_digest_that_collides_with_other_inputs_is_never_reused(backend, monkeypatch):
    """Digests made to collide (here every block hashes alike) find the kept entry, but its inputs at the offsets only
    the server knows differ: nothing is reused and the answer is a fresh computation's. The same inputs still are."""
    monkeypatch.setattr(prefixes, "block_digests", lambda previous, hidden: [b"same"] * (hidden.shape[1] // BLOCK))
    table = session_table(backend)
    first = inputs(3 * BLOCK, seed=6)
    await run(table, "me", "a", first)
    assert table.prefixes is not None and len(table.prefixes.entries) == 1
    other = inputs(3 * BLOCK + 5, seed=7)
    out, reused = await run(table, "me", "b", other)
    assert reused == [0] and table.prefixes.collisions == 1
    assert torch.allclose(out, fresh(backend, other), atol=1e-5)
    again = torch.cat([first, other[:, :5]], dim=1)
    out, reused = await run(table, "me", "c", again)
    assert reused == [3 * BLOCK] and torch.allclose(out, fresh(backend, again), atol=1e-5)


async def test_a_caller_s_own_trails_never_make_its_next_session_busy():
    """A trail counts in its caller's share, but a new session of that caller takes its room back: here the trail grew
    while the new session waited for room, which then came (the share is checked again, the trail goes first)."""
    unit, grown = 1000, 100
    budget = CacheBudget(3 * unit + grown, per_caller=2 * unit)
    store = PrefixStore(budget, lambda sub, batch, length: 0)
    await budget.reserve(unit, 1.0, "me")
    await budget.reserve(2 * unit, 1.0, "you")
    waiting = asyncio.create_task(budget.reserve(unit, 30.0, "me"))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # no room yet
    trail = store.trail("me", 16)
    assert trail.hold is not None and trail.hold(trail, grown)  # it grows meanwhile, within the caller's share
    assert budget.held["me"] == unit + grown
    await budget.release(2 * unit, "you")
    assert await waiting == unit and trail.broken
    assert budget.held["me"] == 2 * unit and store.trail_bytes == 0
