"""Server records as the DHT holds them, with every field filled in (``record(start=2, end=6)`` changes some), and a
swarm view of them by block: what routing, the broker, followers and the checks of training stages are given."""

from __future__ import annotations

from swarm.protocol import PROTOCOL_VERSION
from swarm.records import PeerState, ServerRecord


def record(**over) -> ServerRecord:
    base = dict(
        peer_id="peerA",
        state=PeerState.ONLINE,
        start=0,
        end=4,
        model_id="m",
        num_blocks=8,
        fingerprint="fp",
        dtype="float32",
        device="cpu",
        forward_tps=100.0,
        inference_sps=10.0,
        cache_tokens_free=100,
        cache_tokens_total=100,
        software_version="0",
        protocol_version=PROTOCOL_VERSION,
    )
    base.update(over)
    return ServerRecord(**base)


def view_of(*records, num_blocks=8):
    view = {b: [] for b in range(num_blocks)}
    for r in records:
        for b in range(r.start, r.end):
            view[b].append(r)
    return view
