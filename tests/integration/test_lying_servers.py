"""Servers that lie in their replies (``tests/integration/liar.py``: real peers whose answers are rewritten in their
own process) cost the client a failover each, never a wrong output or an error: a reply without ``hidden``, one far
larger than the request implies, ``bad_input`` to a valid request, an internal "out of memory" failure. With one
honest server beside them, the client's forward and generate equal a local Hugging Face run, and every liar ends
banned."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import local_reference
from tests.integration.harness import check_forward, connect, running_swarm, wait_for
from tests.integration.liar import MODES, start_liar

pytestmark = pytest.mark.slow


def test_lying_servers_are_banned_and_outputs_stay_exact(tiny_models, caplog):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    ids = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    # one honest server, and four liars on the same blocks, each announced ten times faster: routes try them first
    with running_swarm(folder, ["0:4"]) as swarm:
        liars = [start_liar(swarm, mode, "0:4", wait=False) for mode in MODES]
        for liar in liars:
            liar.wait_ready(swarm.startup_timeout)
        liar_ids = {liar.peer_id for liar in liars}
        caplog.set_level(logging.INFO)

        # forward: each liar in turn gets the call (fresh clients have measured nobody yet) and is banned
        with connect(folder, swarm) as client:
            wait_for(lambda: len(client.connection.view.servers()) == 5, 30, "every server in the client's view")
            check_forward(client, ref, 320)
            assert liar_ids <= client.connection.view.banned()
            assert client.failovers == len(MODES) and [h.peer_id for h in client.route] == [swarm.peers[0].peer_id]
        log = caplog.text
        assert "larger than the limit" in log  # the oversized reply was cut off at the request's bound
        assert "replied with tensors ['hidden_states'], not ['hidden']" in log
        assert "refused as bad input, asking another server" in log
        assert "CUDA out of memory" in log

        # generate: the inference sessions' steps, the same way
        with connect(folder, swarm) as client:
            wait_for(lambda: len(client.connection.view.servers()) == 5, 30, "every server in the client's view")
            assert torch.equal(client.generate(ids, max_new_tokens=8, do_sample=False), expected)
            assert liar_ids <= client.connection.view.banned() and client.failovers == len(MODES)
        assert all(liar.proc.poll() is None for liar in liars)  # they lied; they did not crash
