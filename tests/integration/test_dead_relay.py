"""A relay that dies under a chained generation (issue 56, item 3), with real processes on loopback: the route's
second hop is a peer behind NAT (``--reachability private``, no direct plane), reached only through a relay, and
the first hop pushes its steps to it through that relay. The relay is killed (SIGKILL) mid-generation: the loss is
known to the client at once (long before any step's deadline: they are two minutes here), only the hop behind the
dead relay is failed, the session moves to the other server of its blocks, and the tokens are Hugging Face's.

The client's own stream to that hop goes through the same relay, and its end is what the client hears first (in
about 40 ms here, as ``PeerUnavailableError``); a push lost while the client's own link to the next hop stands is
reported by the hop before it (``NextHopUnreachableError``: ``test_busy.py``'s push refuser)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.helpers.swarms import connect, patient_timing, running_swarm, wait_for

pytestmark = pytest.mark.slow  # four peers, one a relay

KILL_AT = 4  # the token after which the relay dies
NEW_TOKENS = 10


def prompt() -> torch.Tensor:
    torch.manual_seed(11)
    return torch.randint(0, 320, (1, 9))


class RelayKiller:
    """A streamer that kills the relay after token ``KILL_AT`` and timestamps every token."""

    def __init__(self, swarm, relay, client) -> None:
        self.swarm, self.relay, self.client = swarm, relay, client
        self.count = -1  # generate's first put() is the prompt
        self.killed_at: float | None = None
        self.route_then: list[str] = []
        self.times: list[float] = []

    def put(self, value) -> None:
        self.count += 1
        self.times.append(time.monotonic())
        if self.count == KILL_AT:
            self.route_then = [h.peer_id for h in self.client.route]
            self.swarm.kill(self.relay)  # by the PID this test started
            self.killed_at = time.monotonic()

    def end(self) -> None:
        pass


def test_a_push_lost_through_a_dead_relay_is_reported_at_once(folder, ref):
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    patient = dataclasses.replace(patient_timing(), step_timeout=120.0, request_timeout=120.0)
    # the first hop (0:2) and a public, slower server of 2:4 that the session moves to
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        first, fallback = swarm.peers
        # the relay: public, offering relaying; it serves 0:2 too, claiming too little speed to be routed through
        relay = swarm.add_peer("0:2", "--relay", "--reachability", "public", "--throughput", "1")
        # behind NAT: reached only through the relay (its records announce only the relayed address), and it claims
        # ten times the other 2:4 server's speed, so the session's route goes through it
        hidden = swarm.add_peer(
            "2:4",
            "--reachability",
            "private",
            "--relay-via",
            relay.maddr,
            "--direct-port",
            "off",
            "--throughput",
            "1000",
        )
        # routes use the three servers only (the relay serves 0:2 too, and new sessions would explore it); none
        # measured yet, so the claims decide: the hidden peer for 2:4
        trusted = [first.peer_id, fallback.peer_id, hidden.peer_id]
        with connect(folder, swarm, timing=patient, chain=True, trusted_peers=trusted) as client:
            view = client.connection.view

            def sees_all() -> bool:
                view.invalidate()
                return {r.peer_id for r in view.servers()} >= set(trusted)

            wait_for(sees_all, timeout=30.0, what="the client seeing every server")
            killer = RelayKiller(swarm, relay, client)
            out = client.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=killer)
            assert torch.equal(out, expected)
            route = [h.peer_id for h in client.route]
            retrier = client.connection.retrier
            assert killer.route_then == [first.peer_id, hidden.peer_id], killer.route_then  # pushes went via the relay
            assert killer.killed_at is not None
            stall = next(t for t in killer.times if t > killer.killed_at) - killer.killed_at
            assert stall < patient.step_timeout / 4, stall  # reported at once, not at the step's deadline
            assert hidden.peer_id in retrier.failures  # the hop behind the dead relay was failed...
            assert first.peer_id not in retrier.failures and fallback.peer_id not in retrier.failures  # ...only it
            assert first.peer_id not in view.banned() and fallback.peer_id not in view.banned()
            assert route == [first.peer_id, fallback.peer_id], route
