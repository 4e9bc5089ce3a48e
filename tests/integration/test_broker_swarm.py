"""Peers started without --blocks: the elected broker places them, keeps a warm standby, promotes it when a serving
peer dies, and is itself replaced when it dies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from swarm.config import Timing
from swarm.dht import RecordStore, current_broker, start_dht
from swarm.hop import Hop
from swarm.records import Lease, PeerState, servers
from tests.helpers.models import local_reference
from tests.helpers.swarms import running_swarm, wait_for

POLICY = ("--max-blocks", "2", "--standby-fraction", "0.25")
pytestmark = pytest.mark.slow


def roles(store: RecordStore, model: str, num_blocks: int) -> dict[str, tuple[str, int, int]]:
    return {r.peer_id: (r.state.value, r.start, r.end) for r in servers(store.view(model, num_blocks)).values()}


def serving(store: RecordStore, model: str, blocks: range) -> set[str]:
    view = store.view(model, max(blocks) + 1)
    return {r.peer_id for b in blocks for r in view[b] if r.state == PeerState.ONLINE}


def covered(store: RecordStore, model: str, num_blocks: int) -> bool:
    view = store.view(model, num_blocks)
    return all(any(r.state == PeerState.ONLINE for r in view[b]) for b in range(num_blocks))


def bottleneck(store: RecordStore, model: str, num_blocks: int) -> float:
    """The smallest total forward throughput over all blocks (each server adds its per-block share)."""
    view = store.view(model, num_blocks)
    return min(sum(r.forward_tps for r in view[b] if r.state == PeerState.ONLINE) for b in range(num_blocks))


def alive_ids(swarm) -> set[str]:
    return {p.maddr.split("/p2p/")[1] for p in swarm.peers if p.maddr and p.proc.poll() is None}


def test_broker_places_promotes_and_survives(tiny_models):
    from swarm import DistributedModelForCausalLM

    folder = str(tiny_models["llama"])
    model = Path(folder).resolve().name
    ref = local_reference(tiny_models["llama"])
    ids = torch.randint(0, 320, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = ref.generate(ids, max_new_tokens=24, do_sample=False)
    timing = dataclasses.replace(Timing.for_tests(), missing_blocks_wait=20.0)
    with running_swarm(folder, [None, None, None, None], *POLICY) as swarm:
        store = start_dht(initial_peers=tuple(swarm.initial_peers), client_mode=True)
        try:
            # 1. full coverage, and one warm standby
            wait_for(lambda: covered(store, model, 4), 30, "coverage")
            state = wait_for(
                lambda: (r := roles(store, model, 4)) and sum(s == "standby" for s, _, _ in r.values()) == 1 and r,
                30,
                "a standby",
            )
            standby_id, (_, s_start, s_end) = next((p, v) for p, v in state.items() if v[0] == "standby")
            # peers that joined a running swarm measured their link to it and told the broker
            heartbeats = store.heartbeats(model)
            assert sum(1 for r in heartbeats if r.network_mbps and r.network_mbps > 0) >= 1

            with DistributedModelForCausalLM.from_pretrained(
                folder, initial_peers=swarm.initial_peers, timing=timing, verify_every=0
            ) as client:
                assert torch.equal(client.generate(ids, max_new_tokens=24, do_sample=False), expected)
                conn = client.connection
                standby = next(r for r in servers(store.view(model, 4)).values() if r.peer_id == standby_id)
                loads = conn.loop.run(conn.remote.info(Hop.of(standby), 5.0)).span_loads

                # 2. kill every server of the standby's span mid-generation: the standby is promoted, tokens intact
                victims = wait_for(
                    lambda: serving(store, model, range(s_start, s_end)) - {standby_id},
                    10,
                    "the servers of the standby's span",
                )
                killed = []

                class Killer:
                    count = -1

                    def put(self, value):
                        self.count += 1
                        if self.count == 8:
                            for pid in victims:
                                swarm.kill(swarm.peer_by_id(pid))
                                killed.append(pid)

                    def end(self):
                        pass

                before = client.failovers
                out = client.generate(ids, max_new_tokens=24, do_sample=False, streamer=Killer())
                assert killed and client.failovers > before and torch.equal(out, expected)
                now = roles(store, model, 4)
                assert now[standby_id][0] == "online" and now[standby_id][1:] == (s_start, s_end)  # promoted in place
                promoted = conn.loop.run(conn.remote.info(Hop.of(standby), 5.0))
                assert promoted.role == "serve" and promoted.span_loads == loads  # no reload

            # 3. kill the broker (once a live peer holds the lease): another is elected once its lease lapses (how soon,
            #    on the lease clock, is test_broker's; here the wait only bounds a hang)
            lease: Lease = wait_for(
                lambda: (b := current_broker(store, model, timing)) and b.holder in alive_ids(swarm) and b,
                20,
                "a live broker",
            )
            swarm.kill(swarm.peer_by_id(lease.holder))
            new: Lease = wait_for(
                lambda: (b := current_broker(store, model, timing)) and b.holder != lease.holder and b,
                60,
                "a new broker",
            )
            # a new term, held by a live peer, that began no earlier than the dead holder's lease we saw lapsed (no
            # pre-emption: the leases' own times)
            assert new.term > lease.term and new.holder in alive_ids(swarm)
            assert new.start >= lease.expires - timing.clock_skew

            # 4. a faster newcomer joins: the broker puts it to work where blocks are weakest
            wait_for(lambda: covered(store, model, 4), 30, "coverage")
            before_bottleneck = bottleneck(store, model, 4)
            newcomer = swarm.add_peer(None, "--throughput", "300")
            new_id = newcomer.maddr.split("/p2p/")[1]
            wait_for(lambda: roles(store, model, 4).get(new_id, ("",))[0] == "online", 30, "the newcomer")
            wait_for(lambda: covered(store, model, 4), 30, "coverage after the newcomer")
            assert bottleneck(store, model, 4) >= before_bottleneck
        finally:
            store.shutdown()
