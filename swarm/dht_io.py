"""Stores and reads over hivemind's DHT that cost what they carry: coroutines run inside the DHT process, on its
``DHTNode``.

hivemind's own ``store_many`` finds a key's replicas with ``rpc_find`` requests that return the key's whole value
from every node asked, and its ``get_many(..., latest)`` merges a copy from every replica and pushes the result to
a further node's cache: under a key that many peers write to, one small store or read moves the whole value five
to ten times. Here the replicas are found by looking up a neighbour of the key (its id with the lowest bit flipped:
the same nearest nodes, and no node holds a value there, so the lookup carries only node addresses), and reused for
``REPLICAS_TTL``; a store goes to them, signed by this node's validator as hivemind's would be; a read takes one copy,
merged from the two nearest replicas that answer with a value. Every value read is still checked by the node's validator
(hivemind's ``call_find`` verifies each subkey's signature) before ``swarm.dht.RecordStore`` checks its author.

A replica that joined since a peer's last store lacks that peer's record until the next one (an announcement
period): a read from it misses the record that long."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

Entries = dict[object, tuple[object, float]]  # subkey -> (value, expiration time)
# a key is taken as unwritten once this many of its replicas answered without a value (a replica that joined since
# the last stores answers so; one that does not answer is passed over)
EMPTY_ANSWERS = 2
READ_COPIES = 2  # replicas a read merges (each answers with its whole copy of the key)
REPLICAS_TTL = 120.0  # seconds a key's replicas, once looked up, are used without a new lookup
# copies of each value: records are stored again every announcement period (a lost copy is back within one), and
# each copy costs its writer the value's bytes again (hivemind's default is 5)
REPLICAS = 3


def _cache(node: Any) -> dict[DHTID, tuple[float, list[tuple[DHTID, Any]]]]:
    """The node's replicas found so far, by key: (when, replicas). Kept on the node (one per DHT process)."""
    cache: dict[DHTID, tuple[float, list[tuple[DHTID, Any]]]] | None = getattr(node, "_swarm_replicas", None)
    if cache is None:
        cache = node._swarm_replicas = {}
    return cache


async def replicas(node: Any, key_ids: list[DHTID]) -> dict[DHTID, list[tuple[DHTID, Any]]]:
    """The ``REPLICAS`` nodes nearest to each key (nearest first), as (node id, peer id); this node among them where
    it stores values (not a client). A lookup costs more than most values (every node asked names its 20 nearest
    nodes for each key), and a key's nearest nodes change only as nodes join and leave: one found is reused for
    ``REPLICAS_TTL``, until one of them does not answer (``forget``) or this node's routing table learns of a node
    nearer to the key (one that joined)."""
    now, out = time.monotonic(), {}
    for key_id in key_ids:
        cached = _cache(node).get(key_id)
        if cached is not None and now - cached[0] < REPLICAS_TTL and not _nearer_known(node, key_id, cached[1]):
            out[key_id] = cached[1]
    probes = {DHTID(int(k) ^ 1): k for k in key_ids if k not in out}
    if probes:
        client = bool(getattr(node.protocol, "client_mode", False))
        k = min(REPLICAS, node.num_replicas)
        found = await node.find_nearest_nodes(list(probes), k_nearest=k, beam_size=k, exclude_self=client)
        for probe, nearest in found.items():
            key_id = probes[probe]
            out[key_id] = sorted(nearest.items(), key=lambda kv: key_id.xor_distance(kv[0]))[:k]
            _cache(node)[key_id] = (now, out[key_id])
    return out


def _nearer_known(node: Any, key_id: DHTID, cached: list[tuple[DHTID, Any]]) -> bool:
    """Whether this node's routing table holds a node nearer to the key than a replica found before, or one more
    where fewer than ``REPLICAS`` were found."""
    known = node.protocol.routing_table.get_nearest_neighbors(key_id, REPLICAS, exclude=node.node_id)
    have = {n for n, _ in cached}
    farthest = key_id.xor_distance(cached[-1][0]) if len(cached) >= REPLICAS else None
    return any(n not in have and (farthest is None or key_id.xor_distance(n) < farthest) for n, _ in known)


def forget(node: Any, key_id: DHTID) -> None:
    """Look the key's replicas up again next time (one of them did not answer)."""
    _cache(node).pop(key_id, None)


async def store_signed(
    node: Any, keys: list[str], values: list[object], expiration: float, subkey: bytes
) -> dict[str, bool]:
    """Store each value under its key in ``subkey``, signed, on the key's replicas: True where one kept it."""
    ids = [DHTID.generate(source=k) for k in keys]
    near = await replicas(node, ids)
    validator, serializer = node.protocol.record_validator, MSGPackSerializer
    subkey_bytes = serializer.dumps(subkey)

    async def one(key_id: DHTID, value: object) -> bool:
        record = DHTRecord(key_id.to_bytes(), subkey_bytes, serializer.dumps(value), expiration)
        signed = validator.sign_value(record) if validator is not None else record.value
        calls, kept = [], False
        for node_id, peer_id in near.get(key_id, []):
            if node_id == node.node_id:
                kept = bool(node.protocol.storage.store(key_id, signed, expiration, subkey=subkey)) or kept
            else:
                calls.append(node.protocol.call_store(peer_id, [key_id], [signed], [expiration], subkeys=[subkey]))
        answers = await asyncio.gather(*calls)
        if any(a is None for a in answers):
            forget(node, key_id)
        return kept or any(a is not None and all(a) for a in answers)

    results = await asyncio.gather(*(one(k, v) for k, v in zip(ids, values, strict=True)))
    return dict(zip(keys, results, strict=True))


def _entries(node: Any, key_id: DHTID, found: Any) -> Entries:
    """A dictionary value as read: each subkey's value, signature stripped, with its expiration time."""
    serializer, validator = MSGPackSerializer, node.protocol.record_validator
    out: Entries = {}
    for subkey, (value_bytes, expiration) in found.value.items():
        if validator is not None:
            record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = validator.strip_value(record)
        try:
            out[subkey] = (serializer.loads(value_bytes), float(expiration))
        except Exception:  # not msgpack: nobody's record (the reader could parse nothing of it)
            continue
    return out


async def read_copies(node: Any, keys: list[str]) -> dict[str, Entries]:
    """Each key's dictionary value, merged from the ``READ_COPIES`` nearest of its replicas that have one (for each
    subkey, the copy that expires last; keys nobody wrote: absent). One copy would do for honest replicas; two keep a
    single replica that withholds or lost some records from hiding them."""
    ids = {DHTID.generate(source=k): k for k in keys}
    near = await replicas(node, list(ids))
    out: dict[str, Entries] = {}
    pending = {k: list(near.get(k, [])) for k in ids}
    copies: dict[DHTID, int] = dict.fromkeys(ids, 0)  # replicas that answered with a value
    empty: dict[DHTID, int] = dict.fromkeys(ids, 0)  # replicas that answered without a value

    def take(key_id: DHTID, found: Any) -> None:
        if found is None or not hasattr(found.value, "items"):
            empty[key_id] += 1
            return
        merged = out.setdefault(ids[key_id], {})
        for subkey, entry in _entries(node, key_id, found).items():
            if subkey not in merged or merged[subkey][1] < entry[1]:
                merged[subkey] = entry
        copies[key_id] += 1

    while pending:
        asks: dict[Any, list[DHTID]] = {}
        for key_id, left in list(pending.items()):
            if not left or copies[key_id] >= READ_COPIES or (not copies[key_id] and empty[key_id] >= EMPTY_ANSWERS):
                del pending[key_id]
                continue
            node_id, peer_id = left.pop(0)
            if node_id == node.node_id:
                take(key_id, node.protocol.storage.get(key_id))
                continue
            asks.setdefault(peer_id, []).append(key_id)
        answers = await asyncio.gather(*(node.protocol.call_find(p, k) for p, k in asks.items()))
        for asked, answer in zip(asks.values(), answers, strict=True):
            if answer is None:
                for key_id in asked:
                    forget(node, key_id)
                continue
            for key_id in asked:
                if key_id in pending and key_id in answer:
                    take(key_id, answer[key_id][0])
    return out
