"""Each supported family, split over two real servers on loopback, equals a local Hugging Face run."""

from __future__ import annotations

import pytest

from tests.conftest import FAMILY_CONFIGS, local_reference
from tests.integration.harness import (
    check_backward,
    check_forward,
    check_greedy,
    check_hidden_states,
    check_score,
    check_session_steps,
    connect,
    running_swarm,
)


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family_swarm(request, tiny_models):
    folder = tiny_models[request.param]
    with running_swarm(str(folder), ["0:2", "1:4"]) as swarm:  # overlapping spans: entered mid-span
        # half the families talk over libp2p only, half over the direct TCP data plane: both paths stay tested
        client = connect(str(folder), swarm, direct="never" if request.param in ("llama", "qwen2") else "auto")
        try:
            yield client, local_reference(folder), swarm
        finally:
            client.close()


def test_forward_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_forward(client, ref, ref.config.vocab_size)
    route = client.route
    assert [(h.start, h.end) for h in route] in ([(0, 1), (1, 4)], [(0, 2), (2, 4)])  # overlap: one side cut short
    assert len({h.peer_id for h in route}) == 2


def test_greedy_generation_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_greedy(client, ref, ref.config.vocab_size)


def test_session_prefill_and_steps_match_local(family_swarm):
    client, ref, _ = family_swarm
    check_session_steps(client, ref, ref.config.vocab_size)


def test_backward_matches_local(family_swarm):
    client, ref, _ = family_swarm
    check_backward(client, ref, ref.config.vocab_size)


def test_scoring_and_hidden_states_match_local(family_swarm):
    """Two procedures that exist only as plans (no RPC of their own): scoring texts and extracting hidden states."""
    client, ref, _ = family_swarm
    check_score(client, ref, ref.config.vocab_size)
    check_hidden_states(client, ref, ref.config.vocab_size)
