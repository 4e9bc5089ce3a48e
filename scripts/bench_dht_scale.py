"""What grows with N, measured: the DHT, the records and the broker at 100, 1,000 and 10,000 servers.

    python scripts/bench_dht_scale.py --servers 100 1000 10000 --nodes 32 --json scale.json \\
        --baseline before.json --plot docs/images/scale_dht.png

``--nodes`` real hivemind DHT nodes run in this process (``DHTNode.create``, each with its own p2pd daemon; 10,000
daemons do not fit one machine), plus one client node (``client_mode``, as a swarm client's) that reads. N simulated
servers of an 80-block model each have their own RSA identity (keys made once in a process pool and cached in
``--keys``: a key takes ~30 ms to make); the broker's real planner (``plan_swarm``) places them on a realistic mix of
GPUs, and each server's ``ServerRecord`` and ``PeerRecord`` are signed with its own key exactly as hivemind's
``RSASignatureValidator`` signs a store (owner marker in the subkey, signature over key, subkey, value and expiry), in
the project's wire form (``Record.to_wire``), under the keys ``RecordStore.announce`` stores them under, and stored on
the ``REPLICAS`` nodes nearest to each key by XOR distance through hivemind's own ``rpc_store`` (so every
value is validated by the node that keeps it). Reads go through the project's ``RecordStore`` over the client node.

Bytes: the protobuf payloads of every DHT request and response a node sends or receives (``ByteSize()`` of each
message, counted by wrapping its ``P2P._call_unary_protobuf_handler``); libp2p framing and encryption are not
counted (a few percent). Measured per N:

- routing one session: a fresh client's ``SwarmView(...).route(0, 80)``: its view read plus the route;
- client view refresh: the same client's next route after ``invalidate`` (its view read again);
- full view: ``RecordStore.view`` of every server (what ``swarm.status``, the judge and a follower read);
- a server's background traffic (bytes/s): its heartbeat and announcement every ``announce_period``, the follower's
  reads of the broker and assignment keys every ``broker_period`` (default ``Timing``), measured on a real server
  node among the DHT nodes, times two: in a DHT of N server nodes each node serves, on average, as many bytes of
  others' stores and lookups as its own cost (each request has one sender and one receiver);
- the broker's round: ``plan_once`` (the peers key read, the live peers, the real planner), bytes read and planning
  time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils.crypto import RSAPrivateKey

import swarm.dht
from harness.sim_servers import (
    BLOCK_BYTES,
    BLOCKS,
    Sim,
    load_keys,
    make_servers,
    peer_record,
    server_record,
    signed_item,
)
from peers.broker.election import Election
from peers.broker.loop import DhtLeaseStore, plan_once
from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm
from swarm.client.swarm_view import SwarmView
from swarm.config import ClientConfig, Timing
from swarm.dht import RecordStore, dht_time
from swarm.identity import owner_of
from swarm.ids import assignment_key, block_key, broker_key, peers_key, shard_of
from swarm.lease import LeaseRules
from swarm.records import Assignment, Lease, ServerRecord


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# copies of each value: what ``RecordStore`` stores (``swarm.dht_io``; before it, hivemind's num_replicas, 5)
REPLICAS: int = getattr(importlib.import_module("swarm.dht_io") if _has("swarm.dht_io") else None, "REPLICAS", 5)


def announce_keys(record: ServerRecord) -> list[str]:
    """Where ``RecordStore.announce`` stores ``record``: a checkout from before per-server records (the baseline)
    stored it under every block key of its span."""
    keys: Callable[[ServerRecord], list[str]] | None = getattr(swarm.dht, "announce_keys", None)
    return keys(record) if keys else [block_key(record.model_id, b) for b in range(record.start, record.end)]


TIMING = Timing()


@dataclass
class Meter:
    """Protobuf payload bytes of a node's DHT requests (sent) and their responses (received)."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0


def metered(node: Any) -> Meter:
    meter, p2p = Meter(), node.protocol.p2p
    original = p2p._call_unary_protobuf_handler

    async def counted(peer_id: Any, name: str, request: Any, output_type: Any) -> Any:
        meter.sent += request.ByteSize()
        meter.calls += 1
        response = await original(peer_id, name, request, output_type)
        meter.received += response.ByteSize()
        return response

    p2p._call_unary_protobuf_handler = counted
    return meter


class LocalDHT:
    """What ``RecordStore`` uses of ``swarm.owned_dht.OwnedDHT``, over a DHTNode of this process's loop thread."""

    def __init__(self, node: Any, loop: asyncio.AbstractEventLoop) -> None:
        # records speak for the key that signs them (a real peer's p2p identity is that same key)
        self.node, self.loop, self.peer_id = node, loop, _Id(owner_of(node.protocol.record_validator.local_public_key))

    def is_alive(self) -> bool:
        return True

    def run_coroutine(self, fn: Callable[..., Coroutine[Any, Any, Any]], return_future: bool = True) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(self, self.node), self.loop)


@dataclass(frozen=True)
class _Id:
    text: str | None

    def to_base58(self) -> str | None:
        return self.text


class Swarm:
    """``n`` DHT nodes (one p2pd each) and a client node, on a loop in a thread of this process."""

    def __init__(self, n: int, staff: list[RSAPrivateKey]) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.staff = staff  # the broker's, a server's and the client's keys
        self.nodes: list[Any] = self.run(self._start(n), 600)
        # the broker's, a server's and the client's nodes measure: none is among the replicas of what they read (in a
        # DHT of N nodes a node is one of a key's 5 replicas for 5 keys in N), so they do not store values
        self.client = self.nodes.pop()
        self.server = self.nodes.pop()
        self.broker = self.nodes.pop()
        self.meters = {id(node): metered(node) for node in (self.broker, self.server, self.client)}

    def meter(self, node: Any) -> Meter:
        return self.meters[id(node)]

    def run(self, coro: Awaitable[Any], timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    async def _start(self, n: int) -> list[Any]:
        host = ["/ip4/127.0.0.1/tcp/0"]
        first = await DHTNode.create(record_validator=RSASignatureValidator(), host_maddrs=host)
        peers = [str(m) for m in await first.get_visible_maddrs()]
        validators = [RSASignatureValidator(RSAPrivateKey()) for _ in range(n - 1)]
        nodes = [first]
        for i in range(0, len(validators), 8):  # a few daemons at a time: a loaded machine starts 32 at once too slowly
            batch = validators[i : i + 8]
            nodes += await asyncio.gather(
                *(DHTNode.create(initial_peers=peers, record_validator=v, host_maddrs=host) for v in batch)
            )
        for key in self.staff:
            validator = RSASignatureValidator(key)
            nodes.append(await DHTNode.create(initial_peers=peers, record_validator=validator, client_mode=True))
        return nodes

    def store(self, node: Any) -> RecordStore:
        validator = node.protocol.record_validator
        return RecordStore(LocalDHT(node, self.loop), validator._private_key, validator, 600.0)  # type: ignore[arg-type]

    def place(self, items: list[tuple[Any, ...]]) -> None:
        """Store signed items on the ``REPLICAS`` nodes nearest to each key, through hivemind's ``rpc_store``."""
        per_node: dict[int, list[tuple[Any, ...]]] = {}
        ids = [node.node_id for node in self.nodes]
        for item in items:
            nearest = sorted(range(len(ids)), key=lambda i: ids[i] ^ item[0])[:REPLICAS]
            for i in nearest:
                per_node.setdefault(i, []).append(item)
        writer = self.client.protocol
        calls = []
        for i, queued in per_node.items():
            for c in range(0, len(queued), 256):
                chunk = queued[c : c + 256]
                calls.append(
                    writer.call_store(
                        self.nodes[i].peer_id,
                        keys=[k for k, _, _, _ in chunk],
                        values=[v for _, _, v, _ in chunk],
                        expiration_time=[e for _, _, _, e in chunk],
                        subkeys=[s for _, s, _, _ in chunk],
                    )
                )

        async def all_calls() -> list[Any]:
            out = []
            for c in range(0, len(calls), 8):
                out += await asyncio.gather(*calls[c : c + 8])
            return out

        results = self.run(all_calls(), 3600)
        assert all(r is not None and all(r) for r in results), "a replica refused a store"

    def shutdown(self) -> None:
        async def stop() -> None:
            await asyncio.gather(*(n.shutdown() for n in self.nodes + [self.broker, self.server, self.client]))

        self.run(stop(), 120)


def measure(swarm: Swarm, keys: list[RSAPrivateKey], n: int) -> dict[str, Any]:
    model_id = f"bench{n}/Llama-2-70b-hf"
    rng = random.Random(n)
    sims, planning = make_servers(keys[:n])
    now, expiration = dht_time(), dht_time() + 3600
    items = []
    records = [server_record(s, model_id, rng) for s in sims if s.info.span is not None]
    for s, r in zip([s for s in sims if s.info.span is not None], records, strict=True):
        items += [signed_item(s.validator, k, r, expiration) for k in announce_keys(r)]
    items += [
        signed_item(s.validator, peers_key(model_id, shard_of(s.peer_id)), peer_record(s, now), expiration)
        for s in sims
    ]
    started = time.perf_counter()
    swarm.place(items)
    print(f"N={n}: {len(items)} signed items placed in {time.perf_counter() - started:.0f} s", flush=True)
    # the broker (one of the DHT nodes) takes the lease and publishes its plan; a server node follows it
    broker = swarm.store(swarm.broker)
    rules = LeaseRules(TIMING.lease_seconds, TIMING.max_tenure, skew=TIMING.clock_skew)
    lease = Election(broker.peer_id, DhtLeaseStore(broker, model_id, TIMING.lease_seconds), dht_time, rules).tick()
    assert lease is not None
    meter_b = swarm.meter(swarm.broker)
    out: dict[str, Any] = {"servers": n, "dht_nodes": len(swarm.nodes), "mean_span": planning["mean_span"]}
    out["first_plan_s"] = planning["first_plan_s"]  # the real planner placing all N from nothing
    # the broker's round: read the heartbeats, plan with the real planner
    planned: list[float] = []

    seen: list[list[PeerInfo]] = []

    def planner(peers: list[PeerInfo]) -> Any:
        seen.append(peers)
        started = time.perf_counter()
        plan = plan_swarm(peers, BLOCKS, BLOCK_BYTES, Policy())
        planned.append(time.perf_counter() - started)
        return plan

    meter_b.reset()
    relaxed = Timing(heartbeat_timeout=7200.0)  # the records were signed minutes ago, at placing
    started = time.perf_counter()
    assignment = plan_once(broker, model_id, planner, broker.peer_id, lease.term, relaxed)
    out["broker_round_s"] = time.perf_counter() - started
    out["broker_plan_s"], out["broker_read_bytes"] = planned[0], meter_b.total
    out["broker_peers_read"] = len(seen[0])  # fewer than N: the read of the heartbeats failed
    out["assignment_placements"] = len(assignment.placements)
    broker.publish(assignment_key(model_id), assignment, expiration)
    # a client: its first route reads the view (routing one session); a later refresh reads it again
    meter_c = swarm.meter(swarm.client)
    client = swarm.store(swarm.client)
    view = SwarmView(client, model_id, BLOCKS, ClientConfig())
    meter_c.reset()
    started = time.perf_counter()
    route = view.route(0, BLOCKS)
    out["route_s"], out["route_bytes"], out["route_hops"] = time.perf_counter() - started, meter_c.total, len(route)
    view.invalidate()  # the client's next refresh: its lookups of the keys' replicas are done
    meter_c.reset()
    started = time.perf_counter()
    view.route(0, BLOCKS)
    out["refresh_s"], out["refresh_bytes"] = time.perf_counter() - started, meter_c.total
    meter_c.reset()  # every server's record (``swarm.status``, the judge, a follower checking a move)
    started = time.perf_counter()
    full = client.view(model_id, BLOCKS)
    out["full_view_s"], out["full_view_bytes"] = time.perf_counter() - started, meter_c.total
    out["view_records"] = sum(len(v) for v in full.values())
    out["dropped"] = dict(client.dropped)
    out |= background(swarm, sims, model_id, rng)
    print(json.dumps(out), flush=True)
    return out


def background(swarm: Swarm, sims: list[Sim], model_id: str, rng: random.Random) -> dict[str, Any]:
    """A server's own periodic DHT traffic (bytes/s), on a real server node, as ``peers.node`` and
    ``peers.follower`` do it with the default timings."""
    node = swarm.server
    meter, store = swarm.meter(node), swarm.store(node)
    typical = next(s for s in sims if s.info.span is not None and s.info.role == Role.SERVE)
    me = Sim(store.validator, store.peer_id, typical.gpu, typical.info)
    record = server_record(me, model_id, rng)
    # the 30 s in which a key's replicas, once looked up, are reused (``swarm.dht_io.REPLICAS_TTL``): 3 announcement
    # periods and 6 broker periods, the first of each with the lookups
    window = 30.0
    meter.reset()
    for _ in range(int(window / TIMING.announce_period)):
        now = dht_time()
        store.heartbeat(model_id, peer_record(me, now), now + TIMING.record_ttl)
        store.announce(record, now + TIMING.record_ttl)
    announce = meter.total
    meter.reset()
    for _ in range(int(window / TIMING.broker_period)):
        store.read(broker_key(model_id), Lease)
        store.read(assignment_key(model_id), Assignment)
    follow = meter.total
    per_s = (announce + follow) / window
    return {
        "server_span": len(record.span),
        "server_announce_bytes_30s": announce,
        "server_follow_bytes_30s": follow,
        "server_own_bps": per_s,
        "server_bps": 2 * per_s,
    }


def _valid(row: dict[str, Any], name: str) -> bool:
    """A broker round whose read of the heartbeats failed measured nothing."""
    return not name.startswith("broker") or row.get("broker_peers_read", row["servers"]) >= row["servers"]


def plot(rows: list[dict[str, Any]], baseline: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    series = [
        ("route_bytes", "routing one session (bytes read)", 1e6),
        ("server_bps", "a server's background traffic (bytes/s)", 5e3),
        ("broker_read_bytes", "broker round (bytes read)", 5e6),
        ("route_s", "routing one session (s)", 2.0),
    ]
    for ax, (name, title, target) in zip(axes, series, strict=True):
        for data, label, style in ((baseline, "before (per-block records)", "o--"), (rows, "after", "o-")):
            pts = [(r["servers"], r[name]) for r in data if name in r and _valid(r, name)]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label)
        ax.axhline(target, color="red", lw=0.8, ls=":", label="target at 1,000 servers")
        ax.set(xscale="log", yscale="log", xlabel="servers (N)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    failed = [r["servers"] for r in rows if not _valid(r, "broker_read_bytes")]
    if failed:
        axes[2].set_xlabel(
            f"servers (N); at {failed[0]:,} the read fails (one DHT value past hivemind's message limit)"
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--nodes", type=int, default=32, help="real DHT nodes (one p2pd each) holding the records")
    parser.add_argument("--keys", type=Path, default=Path("/tmp/dhtscale/keys.pkl"), help="cache of RSA keys")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier run's JSON, plotted as 'before'")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="plot an earlier run's JSON, measure nothing")
    args = parser.parse_args()
    if args.replot:
        base = json.loads(args.baseline.read_text())["rows"] if args.baseline else []
        plot(json.loads(args.replot.read_text())["rows"], base, args.plot)
        return
    keys = load_keys(args.keys, max(args.servers) + 3)
    staff, keys = keys[:3], keys[3:]
    swarm = Swarm(args.nodes, staff)
    try:
        rows = [measure(swarm, keys, n) for n in args.servers]
    finally:
        swarm.shutdown()
    head = ("N", "route MB", "route s", "refresh MB", "full MB", "server B/s", "broker MB", "plan s")
    print("{:>6} {:>9} {:>8} {:>10} {:>8} {:>10} {:>9} {:>7}".format(*head))
    for r in rows:
        print(
            f"{r['servers']:>6} {r['route_bytes'] / 1e6:>9.3f} {r['route_s']:>8.2f} {r['refresh_bytes'] / 1e6:>10.3f} "
            f"{r.get('full_view_bytes', r['refresh_bytes']) / 1e6:>8.3f} "
            f"{r['server_bps']:>10.0f} {r['broker_read_bytes'] / 1e6:>9.3f} {r['broker_plan_s']:>7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "nodes": args.nodes}, indent=1))
    if args.plot:
        base = json.loads(args.baseline.read_text())["rows"] if args.baseline else []
        plot(rows, base, args.plot)


if __name__ == "__main__":
    main()
