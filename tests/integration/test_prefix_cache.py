"""Prefix caching through real servers (issue 59, ``peers.serving.prefixes``): a session that starts with what an
earlier session of the same client sent reuses the whole blocks every server kept of it, chained prompt pieces
included, and gives Hugging Face's logits and greedy tokens; another client (another identity) reuses nothing and
gets the same answer; a client that does not ask is never served from a kept prefix; a server killed in the middle
of a session that reused a kept prefix costs no token (its replacement computes what it lacks). The client claims what
the first hop kept instead of sending it (``swarm.rpc.claims``), and a claim the server cannot honour costs only a
step sent whole."""

from __future__ import annotations

import pytest
import torch

from harness.local_swarm import Disturber
from swarm.rpc.claims import BLOCK, block_digests
from tests.helpers.swarms import connect, patient_timing, running_swarm

pytestmark = pytest.mark.slow
SPANS = ["0:2", "2:4"]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(client, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The session's logits for ``ids``, the positions every hop answered from kept prefixes, and those the first
    hop answered from the client's claim, not sent."""
    with client.inference_session(max_length=ids.shape[1] + 16) as session, torch.inference_mode():
        logits = client(ids).logits
        return logits, session.reused, session.claimed


def test_a_session_that_starts_alike_reuses_every_server_s_kept_prefix_and_answers_exactly(folder, ref):
    first = _ids(200, seed=1)
    later = torch.cat([first[:, :170], _ids(40, seed=2)], dim=1)  # the same first 170 tokens
    with torch.inference_mode():
        expected = ref(later).logits
        greedy = ref.generate(later, max_new_tokens=8, do_sample=False)
    with running_swarm(folder, SPANS) as swarm:
        # prompts go in chained pieces of 128 positions: the second piece goes on from where the first left off
        with connect(folder, swarm, timing=patient_timing(), prefix_cache=True) as client:
            _, reused, claimed = _logits(client, first)
            assert reused == claimed == 0
            logits, reused, claimed = _logits(client, later)
            assert reused == 2 * BLOCK  # whole blocks of the 170 common positions, on both servers
            assert claimed == 2 * BLOCK  # ...which the client did not send the first hop
            assert torch.allclose(logits, expected, atol=1e-4)
            with client.inference_session(max_length=later.shape[1] + 8) as session:  # positions given: the defaults
                assert torch.equal(client.generate(later, max_new_tokens=8, do_sample=False), greedy)
                assert session.claimed == 3 * BLOCK  # what the last session kept (of 210 positions)
            again, reused, claimed = _logits(client, later)  # kept too, by the generation's session: three blocks now
            assert reused == claimed == 3 * BLOCK and torch.allclose(again, expected, atol=1e-4)
            assert client.failovers == 0
        # another identity: nothing of the first's
        with connect(folder, swarm, timing=patient_timing(), prefix_cache=True) as other:
            logits, reused, claimed = _logits(other, later)
            assert reused == claimed == 0 and torch.allclose(logits, expected, atol=1e-4)
        with connect(folder, swarm, timing=patient_timing(), prefix_cache=False) as plain:  # not asked for
            for _ in range(2):
                logits, reused, claimed = _logits(plain, later)
                assert reused == claimed == 0 and torch.allclose(logits, expected, atol=1e-4)


def test_a_claim_the_first_hop_cannot_honour_costs_only_a_step_sent_whole(folder, ref):
    """The client remembers, as if the first hop had kept it, a prompt it never sent (the chain of its embeddings'
    blocks, as that server would key them): its claim is refused (``PrefixUnknownError``), nobody is banned (each
    span has one server), the step goes whole, and the logits are Hugging Face's."""
    kept, never = _ids(200, seed=5), _ids(200, seed=6)
    with torch.inference_mode():
        expected = ref(never).logits
    with running_swarm(folder, SPANS) as swarm:
        with connect(folder, swarm, timing=patient_timing(), prefix_cache=True) as client:
            with client.inference_session(max_length=216) as session, torch.inference_mode():
                client(kept)
                memory = session.conn.claims
            (key,) = memory.keys()  # the first hop's server, span, dtype and the session's scope
            with torch.inference_mode():
                rows = client.get_input_embeddings()(never).to(getattr(torch, key[3]))
            memory.remember(key, block_digests(b"", rows))
            logits, reused, claimed = _logits(client, never)
            assert claimed == reused == 0 and client.failovers == 1
            assert torch.allclose(logits, expected, atol=1e-4)
            assert not memory.keys()  # that server is left alone a while: not even what it keeps now is claimed


def test_a_server_killed_in_a_session_that_reused_its_prefix_costs_no_token(folder, ref):
    first = _ids(200, seed=3)
    later = torch.cat([first[:, :150], _ids(30, seed=4)], dim=1)
    with torch.inference_mode():
        greedy = ref.generate(later, max_new_tokens=24, do_sample=False)
    with running_swarm(folder, ["0:2", "2:4", "2:4"]) as swarm:
        with connect(folder, swarm, timing=patient_timing()) as client:  # prefix caching: the default
            _logits(client, first)  # kept by both servers of the route
            killer = Disturber(client, swarm, {4: 1})  # the second hop, after the fourth new token
            with client.inference_session(max_length=later.shape[1] + 32) as session:
                out = client.generate(later, max_new_tokens=24, do_sample=False, streamer=killer)
                assert session.hop_states[0].reused == 2 * BLOCK  # the first hop went on from its kept prefix
            assert killer.killed and client.failovers >= 1
            assert killer.killed[0] not in {h.peer_id for h in client.route}
            assert torch.equal(out, greedy)


def test_claims_through_a_lossy_codec_are_reused_on_every_hop(folder, ref):
    """Through 8-bit blocks the claimed pieces' outputs travel on in the step's codec, as the first session's did:
    the next hop takes in the same bytes, finds its own kept prefix by them, and every hop reuses the claim."""
    first = _ids(200, seed=7)
    later = torch.cat([first, _ids(20, seed=8)], dim=1)
    with torch.inference_mode():
        expected = ref(later).logits
    with running_swarm(folder, SPANS) as swarm:
        with connect(folder, swarm, timing=patient_timing(), prefix_cache=True, codec="block8") as client:
            _logits(client, first)
            logits, reused, claimed = _logits(client, later)
    assert claimed == reused == 3 * BLOCK  # the least any hop reused: all of the claim, on both
    assert (logits - expected).abs().mean() < 0.15  # 8-bit activations (tests/integration/test_compression.py)
