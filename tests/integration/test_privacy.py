"""The client's privacy options through real swarms on loopback: ``local_blocks`` (the first blocks run on the client,
outputs equal to a local Hugging Face run, and no server is ever asked for them: none serves them here) and
``trusted_peers`` (routes only through the listed peers; blocks none of them serves are missing, not routed to
another peer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.config import Timing
from swarm.errors import BadInputError, MissingBlocksError
from tests.helpers.swarms import (
    check_backward,
    check_forward,
    check_greedy,
    check_hidden_states,
    check_session_steps,
    connect,
    patient_timing,
    running_swarm,
)

VOCAB = 320  # the tiny models'


def test_local_blocks_equal_local_run_and_are_never_asked_of_servers(folder, ref):
    # nobody serves blocks 0:2: every call below would fail with missing blocks if the client routed them
    with running_swarm(folder, ["2:3", "3:4"]) as swarm:
        for chain in (True, False):
            with connect(folder, swarm, local_blocks=2, chain=chain, timing=patient_timing()) as client:
                assert client.local_blocks is not None and client.local_blocks.count == 2
                check_session_steps(client, ref, VOCAB)  # a KV cache on the client for blocks 0:2, one per session
                check_greedy(client, ref, VOCAB, new_tokens=12)
                assert [(h.start, h.end) for h in client.route] == [(2, 3), (3, 4)]
                check_forward(client, ref, VOCAB)
                check_backward(client, ref, VOCAB)  # inputs_embeds, a padded batch, gradients through the local blocks
                assert all(h.start >= 2 for h in client.route)
                check_hidden_states(client, ref, VOCAB, blocks=[2])  # routed from block 2, after the local ones
                with pytest.raises(BadInputError, match="runs on this client"):
                    client.hidden_states(torch.zeros(1, 3, dtype=torch.int64), 1)
                assert client.failovers == 0
        with pytest.raises(BadInputError, match="local_blocks=4"):
            connect(folder, swarm, local_blocks=4)  # the swarm must hold at least the last block
        with pytest.raises(BadInputError, match="tuning"):
            connect(folder, swarm, local_blocks=1, tuning="lora")


def test_trusted_peers_route_only_through_them(folder, ref):
    # the 0:4 peer alone would be the cheapest route; the client trusts only the two others
    with running_swarm(folder, ["0:4", "0:2", "2:4"]) as swarm:
        whole, first, second = (p.peer_id for p in swarm.peers)
        trusted = [first, second]
        with connect(folder, swarm, trusted_peers=trusted, timing=patient_timing()) as client:
            check_greedy(client, ref, VOCAB, new_tokens=8)
            assert [h.peer_id for h in client.route] == trusted
            check_forward(client, ref, VOCAB)
            assert [h.peer_id for h in client.route] == trusted
        with connect(folder, swarm, trusted_peers=[second], local_blocks=2, timing=patient_timing()) as client:
            check_greedy(client, ref, VOCAB, new_tokens=8)  # the trusted peer serves all the swarm has to
            assert [h.peer_id for h in client.route] == [second]
        # blocks 2:4 served by untrusted peers only: missing, with the reason, after a short wait for them
        timing = dataclasses.replace(Timing.for_tests(), missing_blocks_wait=1.0)
        with connect(folder, swarm, trusted_peers=[first], timing=timing) as client:
            with pytest.raises(MissingBlocksError, match=r"block\(s\) 2-3 .*trusted peer"):
                client.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        assert whole not in trusted
