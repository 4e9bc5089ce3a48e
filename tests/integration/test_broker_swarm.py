"""Peers started without --blocks: the elected broker places them, keeps a warm standby, promotes it when a serving
peer dies, and is itself replaced when it dies."""

from __future__ import annotations

import dataclasses
import time

import torch

from swarm.client.routing import servers
from swarm.config import Timing
from swarm.dht import read_all, read_view, start_dht
from swarm.ids import broker_key, peers_key
from swarm.lease import Lease
from swarm.records import PeerRecord, PeerState, parse_as
from swarm.status import current_broker
from tests.conftest import local_reference
from tests.integration.harness import running_swarm, wait_for

POLICY = ("--max-blocks", "2", "--standby-fraction", "0.25")


def roles(dht, model: str, num_blocks: int) -> dict[str, tuple[str, int, int]]:
    return {r.peer_id: (r.state.value, r.start, r.end) for r in servers(read_view(dht, model, num_blocks)).values()}


def serving(dht, model: str, blocks) -> set[str]:
    view = read_view(dht, model, max(blocks) + 1)
    return {r.peer_id for b in blocks for r in view[b] if r.state == PeerState.ONLINE}


def covered(dht, model, num_blocks) -> bool:
    view = read_view(dht, model, num_blocks)
    return all(any(r.state == PeerState.ONLINE for r in view[b]) for b in range(num_blocks))


def bottleneck(dht, model: str, num_blocks: int) -> float:
    """The smallest total forward throughput over all blocks (each server adds its per-block share)."""
    view = read_view(dht, model, num_blocks)
    return min(sum(r.forward_tps for r in view[b] if r.state == PeerState.ONLINE) for b in range(num_blocks))


def broker(dht, model: str) -> Lease | None:
    from hivemind.utils import get_dht_time

    return current_broker(read_all(dht, broker_key(model)), get_dht_time())


def test_broker_places_promotes_and_survives(tiny_models):
    from swarm import DistributedModelForCausalLM

    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    ids = torch.randint(0, 320, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = ref.generate(ids, max_new_tokens=24, do_sample=False)
    timing = dataclasses.replace(Timing.for_tests(), missing_blocks_wait=20.0)
    with running_swarm(folder, [None, None, None, None], *POLICY) as swarm:
        dht, _ = start_dht(initial_peers=tuple(swarm.initial_peers), client_mode=True)
        try:
            # 1. full coverage, and one warm standby
            wait_for(lambda: covered(dht, folder_id(folder), 4), 30, "coverage")
            state = wait_for(
                lambda: (
                    (r := roles(dht, folder_id(folder), 4)) and sum(s == "standby" for s, _, _ in r.values()) == 1 and r
                ),
                30,
                "a standby",
            )
            standby_id, (_, s_start, s_end) = next((p, v) for p, v in state.items() if v[0] == "standby")
            # peers that joined a running swarm measured their link to it and told the broker
            heartbeats = [parse_as(PeerRecord, v) for v in read_all(dht, peers_key(folder_id(folder)))]
            assert sum(1 for r in heartbeats if r and r.network_mbps and r.network_mbps > 0) >= 1

            with DistributedModelForCausalLM.from_pretrained(
                folder, initial_peers=swarm.initial_peers, timing=timing
            ) as client:
                assert torch.equal(client.generate(ids, max_new_tokens=24, do_sample=False), expected)

                # 2. kill every server of the standby's span mid-generation: the standby is promoted, tokens intact
                victims = wait_for(
                    lambda: serving(dht, folder_id(folder), range(s_start, s_end)) - {standby_id},
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

                out = client.generate(ids, max_new_tokens=24, do_sample=False, streamer=Killer())
                assert killed and torch.equal(out, expected)
                now = roles(dht, folder_id(folder), 4)
                assert now[standby_id][0] == "online" and now[standby_id][1:] == (s_start, s_end)  # promoted in place
                assert "loading blocks as serve" not in _log_after_start(swarm, standby_id)

            # 3. kill the broker: another is elected within two lease periods, coverage holds
            lease = wait_for(lambda: broker(dht, folder_id(folder)), 10, "a broker")
            alive = {p.maddr.split("/p2p/")[1] for p in swarm.peers if p.proc.poll() is None}
            if lease.holder in alive:
                swarm.kill(swarm.peer_by_id(lease.holder))
                t0 = time.monotonic()
                new = wait_for(
                    lambda: (b := broker(dht, folder_id(folder))) and b.holder != lease.holder and b,
                    2 * timing.lease_seconds + 5,
                    "a new broker",
                )
                assert new.term > lease.term and time.monotonic() - t0 < 2 * timing.lease_seconds + 5
            # 4. a faster newcomer joins: the broker puts it to work where blocks are weakest
            wait_for(lambda: covered(dht, folder_id(folder), 4), 30, "coverage")
            before = bottleneck(dht, folder_id(folder), 4)
            newcomer = swarm.add_peer(None, "--throughput", "300")
            new_id = newcomer.maddr.split("/p2p/")[1]
            wait_for(lambda: roles(dht, folder_id(folder), 4).get(new_id, ("",))[0] == "online", 30, "the newcomer")
            wait_for(lambda: covered(dht, folder_id(folder), 4), 30, "coverage after the newcomer")
            assert bottleneck(dht, folder_id(folder), 4) >= before
        finally:
            dht.shutdown()


def folder_id(folder: str) -> str:
    from pathlib import Path

    return Path(folder).resolve().name


def _log_after_start(swarm, peer_id: str) -> str:
    """The peer's log after its first placement (promotion must not reload weights)."""
    text = swarm.peer_by_id(peer_id).log_path.read_text()
    first = text.find("loading blocks as")
    return text[text.find("\n", first) :] if first >= 0 else text
