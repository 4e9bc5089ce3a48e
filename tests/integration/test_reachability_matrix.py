"""Every pair of reachabilities connects (issue 56, item 5): a client and a volunteer server each public, behind a
full-cone NAT, a port-restricted NAT, a symmetric NAT, a stateful firewall that translates nothing, or a double
(carrier-grade) NAT, in the WAN emulator at 10 ms a link. A 6-block tiny Llama (perturbed weights) is served one
block per volunteer kind, so every client-mediated route goes through all six; one client per kind generates, and
each gets the local Hugging Face run's tokens with no server banned, on the product's own session timeouts (a punch
that cannot work must leave the relay time to carry the session). Needs root, /dev/net/tun and ``ip``; skipped
otherwise."""

from __future__ import annotations

import time

import pytest
import torch

from harness.wan import Wan, WanConfig, unavailable_reason
from harness.wan.config import NatConfig
from harness.wan.nodes import ClientJob, WanSwarm
from tests.helpers.models import local_reference, make_tiny_model

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

DELAY_MS = 10.0
NEW_TOKENS = 6
JOB_TIMEOUT = 180.0
PUBLIC = ("--relay", "--reachability", "public")
KINDS = ("public", "full", "port", "sym", "fw", "dbl")
NAT_OF = {"full": "full-cone", "port": "port-restricted", "sym": "symmetric", "fw": "firewall"}


def nats_for(node: str, kind: str) -> list[NatConfig]:
    """The boxes in front of ``node`` for ``kind`` (a double NAT: a home router behind the carrier's)."""
    if kind == "public":
        return []
    if kind == "dbl":
        return [
            NatConfig(name=f"home-{node}", kind="port-restricted", inside=(node,)),
            NatConfig(name=f"cgn-{node}", kind="port-restricted", inside=(f"home-{node}",)),
        ]
    return [NatConfig(name=f"nat-{node}", kind=NAT_OF[kind], inside=(node,))]


@pytest.fixture(scope="module")
def six_blocks(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-6") / "model"
    return str(make_tiny_model(folder, "llama", perturb=0.02, num_hidden_layers=6))


@pytest.fixture(scope="module")
def matrix(six_blocks, tmp_path_factory, fork_server):
    """Servers: ``v-public`` (a relay, block 0) and ``relay2`` (a second public relay, block 0 too: two observers, as
    a symmetric NAT needs to be seen), then one volunteer of each other kind on blocks 1..5. Clients: ``c-KIND``."""
    logs = tmp_path_factory.mktemp("reach-matrix")
    volunteers = {f"v-{k}": k for k in KINDS}
    clients = {f"c-{k}": k for k in KINDS}
    nats = [box for node, kind in {**volunteers, **clients}.items() for box in nats_for(node, kind)]
    nodes = ("v-public", "relay2", *[v for v in volunteers if v != "v-public"], *clients)
    cfg = WanConfig(nodes=nodes, delay_ms=DELAY_MS, nats=tuple(nats))
    with Wan(cfg) as wan:
        spans = {"v-public": "0:1", "relay2": "0:1"}
        with WanSwarm(
            wan, six_blocks, spans, node_args={"v-public": PUBLIC, "relay2": PUBLIC}, log_dir=logs, fork=fork_server
        ) as swarm:
            started = [
                swarm.add_peer(f"{i}:{i + 1}", node=node, wait=False)
                for i, node in enumerate([v for v in volunteers if v != "v-public"], start=1)
            ]
            for peer in started:
                peer.wait_ready(swarm.startup_timeout)
            swarm.logs = logs  # type: ignore[attr-defined]
            yield wan, swarm


def prompt() -> list[int]:
    torch.manual_seed(56)
    return torch.randint(0, 320, (8,)).tolist()


def test_every_pair_of_reachabilities_generates_hugging_face_tokens(matrix, six_blocks) -> None:
    wan, swarm = matrix
    ref = local_reference(six_blocks)
    out = ref.generate(
        torch.tensor([prompt()]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    expected = out[0].tolist()
    # block 0 is served by both relays, two public volunteers: either carries the client's pair with a public one
    volunteers = {p.peer_id: swarm.node_of[p.pid].replace("relay2", "v-public") for p in swarm.peers}
    spec = dict(
        model=six_blocks,
        initial_peers=[m for m in swarm.initial_peers if "/p2p-circuit" not in m],
        # the product's own session timeouts (a punch that fails must leave the relay time to open the session);
        # only the wait for a first view of the swarm is patient, for a machine busy with other tests
        test_timings=False,
        timing={"missing_blocks_wait": 60.0},
        tasks=["generate"],
        modes=[{"name": "mediated", "chain": False, "codec": "none"}],
        prompt=prompt(),
        max_new_tokens=NEW_TOKENS,
        warmup=False,
    )
    t0 = time.monotonic()
    results = {}
    for wave in (KINDS[:3], KINDS[3:]):  # three clients at a time: six at once starve a 2-core machine
        jobs = {kind: ClientJob(wan, f"c-{kind}", spec, log_path=swarm.logs / f"client-{kind}.log") for kind in wave}
        try:
            for kind, job in jobs.items():
                results[kind] = [r for r in job.lines(JOB_TIMEOUT) if r.get("task") == "generate"]
        finally:
            for job in jobs.values():
                job.close()
    print(f"six clients in {time.monotonic() - t0:.1f} s")
    carried = {}
    for kind, got in results.items():
        assert len(got) == 1, (kind, got)
        (result,) = got
        route = [volunteers[p] for p in result["route"]]
        assert result["tokens"] == expected, kind
        assert result["failovers"] == 0, (kind, route, result["punched"])  # nobody banned: every pair connected
        assert set(route) >= {f"v-{k}" for k in KINDS if k != "public"}, (kind, route)
        for peer, node in volunteers.items():
            if peer in result["route"]:
                carried[kind, node[2:]] = carrier(result["punched"], peer, node == "v-public")
        row = {k[1]: v for k, v in carried.items() if k[0] == kind}
        print(kind, f"first token {result['first_token_s']:.2f} s, step {result['step_s']:.3f} s", row)
    # the direct plane where the NATs allow it: every pair but those with a symmetric NAT is dialled or punched
    assert len(carried) == len(KINDS) ** 2, sorted(carried)
    for (client, volunteer), how in carried.items():
        if volunteer == "public":
            assert how == "direct", (client, volunteer, how)
        elif volunteer == "sym" and client in ("public", "full"):
            # reached by its SYNs where it punches; relayed where it saw two observers and knows it cannot
            assert how in ("reverse", "relay"), (client, volunteer, how)
        elif "sym" in (client, volunteer):
            assert how == "relay", (client, volunteer, how)
        elif client in ("public", "full"):  # a reachable client: the volunteer's SYNs open the connection
            assert how in ("reverse", "punch"), (client, volunteer, how)
        else:
            assert how == "punch", (client, volunteer, how)


def carrier(punched: dict[str, int], peer: str, public: bool) -> str:
    """What carried the client's session with ``peer``, from the client's counters."""
    if public:
        return "direct"
    if punched.get(f"punched_reverse:{peer}"):
        return "reverse"
    return "punch" if punched.get(f"punched:{peer}") else "relay"
