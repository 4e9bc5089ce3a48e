"""A malicious participant, in a process of its own, speaking the real protocol on loopback: its own libp2p identity
and DHT peer, signed values where signing helps it and raw unsigned ones where it does not, real RPC calls to real
servers, a real hivemind averager. The tests in ``test_attacks.py`` start it and check that every attack fails.

    python -m tests.helpers.attacker ATTACK --initial-peers MADDR... --model-id ID --num-blocks N [options]

Each attack prints one JSON line on stdout (what it did, and what the servers answered) and exits.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from swarm import wire
from swarm.config import Timing
from swarm.dht import RecordStore, _get_subkeys, _store_records, announce_keys, dht_time, start_dht
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.identity import owner_of
from swarm.ids import assignment_key, broker_key
from swarm.membership import SwarmKey
from swarm.protocol import (
    PROTOCOL_VERSION,
    RPC_PUSH,
    ForwardRequest,
    InferenceRequest,
    InferenceStep,
    OpenSession,
    PassPush,
    PushStep,
)
from swarm.records import (
    SCHEMA_VERSION,
    Assignment,
    Lease,
    PeerRecord,
    PeerState,
    Placement,
    ServerRecord,
    servers,
)
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote
from swarm.rpc.stream import open_session
from tests.helpers.attacker_passes import push_passes
from tests.helpers.attacker_training import attack_training, errors_of, huge_notice, join_averaging

TIMING = Timing.for_tests()


def _server_record(store: RecordStore, args: argparse.Namespace, **fields: Any) -> ServerRecord:
    base: dict[str, Any] = dict(
        peer_id=store.peer_id,
        maddrs=tuple(store.visible_maddrs()),
        state=PeerState.ONLINE,
        start=0,
        end=args.num_blocks,
        model_id=args.model_id,
        num_blocks=args.num_blocks,
        fingerprint="0" * 16,
        dtype="float32",
        device="cuda",
        forward_tps=1e12,
        inference_sps=1e9,
        cache_tokens_free=1 << 30,
        cache_tokens_total=1 << 30,
        software_version="9",
        protocol_version=PROTOCOL_VERSION,
    )
    base.update(fields)
    return ServerRecord(**base)


def _stored(put: Callable[[], bool], seconds: float = 60.0) -> bool:
    """``put`` repeated until the DHT took it, as a real attacker would repeat it (and as an honest peer announces
    again at every heartbeat): on a loaded machine one store can miss its nodes' replies. False if it never took."""
    deadline = time.monotonic() + seconds
    while not (took := put()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return took


def _raw_store(store: RecordStore, keys: list[str], value: dict[str, Any], subkey: bytes) -> bool:
    """A value under any subkey, signed or not, however malformed: what hivemind itself lets anyone store."""
    fn = partial(_store_records, keys=keys, values=[value] * len(keys), expiration=dht_time() + 60, subkey=subkey)
    return all(store._call(fn).values())


def attack_records(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """Forged and foreign-key records, a shadow of an honest peer, fake leases and assignments, a malformed lease,
    future-dated heartbeats. The DHT keeps one value per key and author, so the attacker uses three identities (a
    Sybil costs it nothing)."""
    store, second, third = stores
    now = dht_time()
    view = store.view(args.model_id, args.num_blocks)
    honest = sorted(servers(view))
    victim = view[0][0]
    done: dict[str, Any] = {"honest": honest, "sybils": [second.peer_id, third.peer_id]}
    # 1. an unsigned record claiming every block, its own weights and an absurd speed (hivemind stores it unsigned)
    unsigned = _server_record(store, args)  # where readers look for its author's record (``announce_keys``)
    done["unsigned"] = _stored(lambda: _raw_store(store, announce_keys(unsigned), unsigned.to_wire(), b"forged"))
    # 2. a signed record of its own: valid, but of weights no client holds
    done["own_weights"] = _stored(lambda: second.announce(_server_record(second, args), now + 60))
    # 3. the honest peer's id with the attacker's address (a shadow), in the attacker's own signed subkey, and the
    #    same shadow unsigned
    shadow = victim.model_copy(update={"maddrs": tuple(store.visible_maddrs()), "forward_tps": 1e12})
    done["shadow"] = _stored(lambda: store.announce(shadow, now + 60))
    done["shadow_unsigned"] = _stored(lambda: _raw_store(store, announce_keys(shadow), shadow.to_wire(), b"shadow"))
    # 4. a lease with a huge term (and an assignment under it making every honest peer a standby); a lease for the
    #    next term while the broker's is live (and its assignment); an assignment in the honest broker's name
    standby = {p: Placement(start=0, end=1, role="standby") for p in honest}
    huge = Lease(term=2**62, holder=store.peer_id, start=now, expires=now + TIMING.lease_seconds)
    done["huge_lease"] = _stored(lambda: store.publish(broker_key(args.model_id), huge, now + 60))
    plan = Assignment(term=2**62, broker=store.peer_id, issued_at=now, placements=standby)
    store.publish(assignment_key(args.model_id), plan, now + 60)
    leases = [lease for lease in store.read(broker_key(args.model_id), Lease) if lease.holder in honest]
    term = max((lease.term for lease in leases), default=0) + 1
    early = Lease(term=term, holder=third.peer_id, start=now, expires=now + TIMING.lease_seconds)
    done["next_term_lease"] = _stored(lambda: third.publish(broker_key(args.model_id), early, now + 60))
    plan = Assignment(term=term, broker=third.peer_id, issued_at=now, placements=standby)
    third.publish(assignment_key(args.model_id), plan, now + 60)
    owner = leases[0].holder if leases else honest[0]
    plan = Assignment(term=term - 1, broker=owner, issued_at=now + 1, placements=standby)
    done["foreign_assignment"] = _stored(lambda: second.publish(assignment_key(args.model_id), plan, now + 60))
    # 5. an assignment in the lease holder's name under a subkey that carries the holder's key and then its own
    #    (hivemind signs with the first marker it finds; a reader must not take the holder's for the author)
    raw = store._call(partial(_get_subkeys, key=broker_key(args.model_id)))
    holder_key = next((sub for sub in raw if isinstance(sub, bytes) and owner_of(sub) == owner), None)
    if holder_key is not None and leases:
        confusing = holder_key[:-1] + b"\n" + store.validator.local_public_key
        lease = max((lease for lease in leases if lease.holder == owner), key=lambda lease: lease.term)
        plan = Assignment(
            term=lease.term, broker=owner, issued_at=now + 5, placements={victim.peer_id: standby[victim.peer_id]}
        )
        done["owner_confusion"] = _stored(
            lambda: _raw_store(store, [assignment_key(args.model_id)], plan.to_wire(), confusing)
        )
    # 6. a malformed lease, signed: a term that is not a number
    bad = {
        "schema_version": SCHEMA_VERSION,
        "term": "infinity",
        "holder": second.peer_id,
        "start": now,
        "expires": now + 1e9,
    }
    done["malformed_lease"] = _stored(
        lambda: _raw_store(second, [broker_key(args.model_id)], bad, second.validator.local_public_key)
    )
    # 7. a heartbeat dated far in the future, claiming a huge throughput (would never expire, would be placed first)
    beat = PeerRecord(
        peer_id=third.peer_id,
        state=PeerState.JOINING,
        block_throughput=1e12,
        memory=1 << 40,
        max_blocks=1000,
        updated_at=now + 10**6,
    )
    done["future_heartbeat"] = _stored(lambda: third.heartbeat(args.model_id, beat, now + 60))
    return done


def seize_broker(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """Watch the lease the swarm obeys (say "ready" once it sees one), wait until no live lease is left (the honest
    broker died), claim the next term, and publish plans that would uncover blocks: every peer a standby, then every
    peer on the first block only. Renew until a line on stdin says to stop (the test has seen the swarm's rounds
    since), or for ``--seconds`` after "ready" at most."""
    from swarm.lease import LeaseRules, LeaseView

    store = stores[0]
    me = store.peer_id
    rules = LeaseRules(TIMING.lease_seconds, TIMING.max_tenure, skew=TIMING.clock_skew)
    view = LeaseView(rules)
    lease: Lease | None = None
    published = 0
    while view.resolve(store.read(broker_key(args.model_id), Lease), dht_time()) is None:
        time.sleep(TIMING.broker_period)  # it watches the lease the swarm obeys, as a follower would
    print("ready", flush=True)  # the test kills the honest broker now
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        now = dht_time()
        current = view.resolve(store.read(broker_key(args.model_id), Lease), now)
        if lease is None and current is None and view.term is not None:
            lease = Lease(term=view.term + 1, holder=me, start=now, expires=now + TIMING.lease_seconds)
        if lease is not None:
            lease = lease.model_copy(update={"expires": now + TIMING.lease_seconds})
            store.publish(broker_key(args.model_id), lease, now + 60)
            honest = sorted(p for p in servers(store.view(args.model_id, args.num_blocks)) if p != me)
            role = "standby" if published % 2 == 0 else "serve"
            placements = {p: Placement(start=0, end=1, role=role) for p in honest}
            plan = Assignment(term=lease.term, broker=me, issued_at=now, placements=placements)
            store.publish(assignment_key(args.model_id), plan, now + 60)
            published += 1
        if select.select([sys.stdin], [], [], TIMING.broker_period)[0]:  # a broker's round, or the word to stop
            break
    return {"term": lease.term if lease is not None else None, "plans": published}


def outsider(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """Against a private swarm, without its key (or with another): join its DHT, then, with its own DHT peer and
    the addresses of one server (as a leak would give them), call every RPC on both planes."""
    key = SwarmKey.load(Path(args.swarm_key)) if args.swarm_key else None
    done: dict[str, Any] = {}
    try:
        stores.append(
            start_dht(
                initial_peers=tuple(args.initial_peers),
                timeout=TIMING.dht_start_timeout,
                call_timeout=TIMING.dht_timeout,
                swarm_key=key,
            )
        )
        done["join"] = "ok"
    except SwarmError as e:
        done["join"] = f"{type(e).__name__}: {e}"
    if not stores:  # refused: go on alone, knowing the server's addresses
        stores.append(start_dht(timeout=TIMING.dht_start_timeout, call_timeout=TIMING.dht_timeout, swarm_key=key))
    store = stores[0]
    done["servers_seen"] = len(servers(store.view(args.model_id, args.num_blocks)))
    target = json.loads(args.hop)
    hop = Hop(target["peer_id"], target["start"], target["end"], tuple(target["maddrs"]), direct=target["direct"])
    loop = LoopThread("outsider")
    try:
        p2p = loop.run(store.replicate_p2p())
        hidden = {"hidden": torch.zeros(1, 2, args.hidden_size)}
        forward = ForwardRequest(start=hop.start, end=hop.end)
        opening = InferenceRequest(
            open=OpenSession(session_id="outsider", start=hop.start, end=hop.end, max_length=8, batch_size=1)
        )
        for plane in ("never", "always"):
            remote = Remote(p2p, store.credentials(), plane)  # type: ignore[arg-type]
            done[f"forward_{plane}"] = errors_of(loop, remote, hop, [("forward", forward, hidden)])["forward"]
            try:
                stream = loop.run(open_session(remote, hop, 10.0))
                loop.run(stream.exchange(opening, {}, 10.0))
                done[f"session_{plane}"] = "ok"
                stream.close()
            except SwarmError as e:
                done[f"session_{plane}"] = f"{type(e).__name__}: {e}"
            remote.close()
        try:
            loop.run(Remote(p2p, store.credentials(), "never").info(hop, 10.0))
            done["info"] = "ok"
        except SwarmError as e:
            done["info"] = f"{type(e).__name__}: {e}"
    finally:
        loop.close(5.0)
    return done


def push_into(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """Push steps into an honest client's chained session on a server, over both planes and under every route
    generation up to 3: the server must take pushes only from the hop before it on the client's signed route. Then,
    on each plane, one push of a chained training pass's activation: an inference-only server takes none.
    Started ahead (a DHT peer takes seconds), it says ``ready`` and then reads the target from stdin: one JSON line
    with the server's hop, the client's peer id, its session id there and its position (as a leak would give them).
    After each plane's pushes it says how many it has sent, in how many bytes, and keeps the stream open until a line
    on stdin says the server has read them (the test sees the bytes in the server's count of what it received)."""
    loop = LoopThread("pusher")
    sent = passes = 0
    try:
        p2p = loop.run(stores[0].replicate_p2p())
        print(json.dumps({"ready": True, "peer_id": stores[0].peer_id}), flush=True)
        target = json.loads(sys.stdin.readline())
        h = target["hop"]
        hop = Hop(h["peer_id"], h["start"], h["end"], tuple(h["maddrs"]), direct=h["direct"])
        hidden = {"hidden": torch.full((1, 1, args.hidden_size), 7.0)}
        for plane in ("never", "always"):
            remote = Remote(p2p, stores[0].credentials(), plane)  # type: ignore[arg-type]
            channel = loop.run(remote.open_channel(hop, RPC_PUSH))
            nbytes = 0
            for generation in range(4):
                push = PushStep(
                    client=target["client"],
                    session_id=target["session"],
                    generation=generation,
                    step=InferenceStep(position=target["position"], hops=0),
                )
                frames = wire.encode(remote.meta(push), hidden)
                loop.run(channel.send(frames))
                nbytes += wire.encoded_size(frames)
                sent += 1
            frames = wire.encode(remote.meta(PassPush(client=target["client"], key=f"pass-{plane}")), hidden)
            loop.run(channel.send(frames))
            nbytes += wire.encoded_size(frames)
            passes += 1
            print(json.dumps({"sent": sent, "bytes": nbytes}), flush=True)
            sys.stdin.readline()
            channel.close()
            remote.close()
    finally:
        loop.close(5.0)
    return {"pushes": sent, "passes": passes}


MARKUP = '<img src=x onerror="document.title=1">'


def markup(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """A record of its own, validly signed, whose free-text fields are markup (and a device name 1,000 characters
    long): what anyone may announce, and what a dashboard must show as bounded text, never run."""
    store = stores[0]
    record = _server_record(store, args, device=MARKUP + "x" * 1000, dtype="<b>float32</b>")
    return {"announced": _stored(lambda: store.announce(record, dht_time() + 60)), "markup": MARKUP}


ATTACKS = {
    "markup": markup,
    "records": attack_records,
    "outsider": outsider,
    "broker": seize_broker,
    "training": attack_training,
    "notice": huge_notice,
    "averaging": join_averaging,
    "push": push_into,
    "passes": push_passes,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.attacker")
    p.add_argument("attack", choices=sorted(ATTACKS))
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--honest", default="", help="the honest trainer's peer id")
    p.add_argument("--trainers-key", default="")
    p.add_argument("--step", type=int, default=0, help="the run's current step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--prefix", default="", help="the averaging group prefix")
    p.add_argument("--shapes", default="", help="a JSON file: the shapes of the tensors the replicas average")
    p.add_argument("--groups", type=int, default=2, help="averaging: stop once in this many of the replicas' groups")
    p.add_argument("--hop", default="", help="outsider: the JSON of one server's hop (peer_id, span, addresses)")
    p.add_argument("--swarm-key", default="", help="outsider: a key file of its own (default: none)")
    p.add_argument("--identity", default="", help="the key file of its first identity (default: a new key)")
    p.add_argument("--control", default="", help="passes: the folder whose files drive it")
    args = p.parse_args(argv)
    stores: list[RecordStore] = []
    try:
        for k in range({"records": 3, "training": 3, "outsider": 0, "passes": 2}.get(args.attack, 1)):
            stores.append(
                start_dht(
                    initial_peers=tuple(args.initial_peers),
                    identity=Path(args.identity) if args.identity and k == 0 else None,
                    timeout=TIMING.dht_start_timeout,
                    call_timeout=TIMING.dht_timeout,
                    # the records attack's forgeries must outlive this process for the test to read them: a DHT
                    # node of its own would be among the nodes nearest to some keys, and keep their copies itself
                    client_mode=args.attack == "records",
                )
            )
        result = ATTACKS[args.attack](stores, args)
        print(json.dumps({"attacker": stores[0].peer_id, **result}), flush=True)
    finally:
        for store in stores:
            store.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
