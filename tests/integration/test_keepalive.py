"""A route's other hops are kept alive while one hop is repaired (``swarm.client.session.keepalive``): a repair that
outlasts the servers' idle limit (the tests' 5 s) must not end the sessions of the hops left waiting, which the next
steps would otherwise find expired one at a time, each repair long enough to expire the rest again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.local_swarm import Disturber
from tests.helpers.slow_replay import start_slow_replay
from tests.helpers.swarms import connect, patient_timing, running_swarm

pytestmark = pytest.mark.slow  # four servers, one taking 8 s to replay a history

REPLAY_S = 8.0  # the replacement's replay: longer than a server's idle limit under the tests' timings (5 s)


@pytest.mark.parametrize("chain", [True, False], ids=["chained", "mediated"])
def test_a_repair_longer_than_the_idle_limit_keeps_the_first_hop(folder, ref, chain):
    """Route 0:1, 1:3, 3:4; the last hop's server is killed after 3 tokens and replaced by a server that takes 8 s to
    replay the history (chained, the middle hop, which could not push to it, is replaced too). The hops left waiting
    hear nothing from the client meanwhile but the keep-alives: their sessions stay open, so the whole repair is one
    failover (without them the next step finds them expired: more failovers and replays; measured 2 chained, 3
    mediated), and the tokens are Hugging Face's."""
    torch.manual_seed(11)
    ids = torch.randint(0, 320, (1, 9))
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    with running_swarm(folder, ["0:1", "1:3", "3:4"]) as swarm:
        slow = start_slow_replay(swarm, REPLAY_S, "3:4")
        # the 8 s replay is no fault: steps may take a minute
        timing = dataclasses.replace(patient_timing(), step_timeout=60.0, request_timeout=60.0)
        with connect(folder, swarm, timing=timing, chain=chain) as client:
            killer = Disturber(client, swarm, {3: 2})
            out = client.generate(ids, max_new_tokens=8, do_sample=False, streamer=killer)
            route = [h.peer_id for h in client.route]
            failovers = client.failovers
    assert torch.equal(out, expected)
    assert killer.killed and killer.killed[0] not in route and route[-1] == slow.peer_id  # the slow one replayed
    assert failovers == 1, failovers
