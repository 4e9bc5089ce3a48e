"""A simulated population of volunteer servers for ``scripts/bench_dht_scale.py``: real RSA identities (made once in a
process pool and cached), a realistic mix of GPUs placed by the broker's real planner (``plan_swarm``) on an 80-block
model, and each server's ``ServerRecord`` and ``PeerRecord`` signed with its own key exactly as hivemind's
``RSASignatureValidator`` signs a store."""

from __future__ import annotations

import os
import pickle
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from peers.broker.planner import PeerInfo, Policy, Role, plan_swarm
from swarm.identity import owner_of
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import PeerRecord, PeerState, Record, ServerRecord
from swarm.version import __version__

BLOCKS = 80
BLOCK_BYTES = 1_750_000_000  # one Llama-2-70B block in bf16
GPUS = [  # (name, memory GiB, share of volunteers, relative speed)
    ("NVIDIA GeForce RTX 3090", 24, 0.3, 1.0),
    ("NVIDIA GeForce RTX 4090", 24, 0.3, 1.6),
    ("NVIDIA A100-SXM4-80GB", 80, 0.2, 2.5),
    ("NVIDIA H100 80GB HBM3", 80, 0.1, 4.0),
    ("NVIDIA A10G", 24, 0.1, 0.8),
]


def _make_keys(n: int) -> list[bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    der = serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return [rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(*der) for _ in range(n)]


def load_keys(path: Path, n: int) -> list[RSAPrivateKey]:
    """``n`` RSA-2048 keys, made once (in a process pool) and cached at ``path`` for later runs."""
    keys: list[bytes] = pickle.loads(path.read_bytes()) if path.exists() else []
    if len(keys) < n:
        missing, workers = n - len(keys), os.cpu_count() or 1
        with ProcessPoolExecutor(workers) as pool:
            keys += [k for chunk in pool.map(_make_keys, [missing // workers + 1] * workers) for k in chunk]
        path.write_bytes(pickle.dumps(keys))
    from cryptography.hazmat.primitives import serialization

    out = []
    for der in keys[:n]:
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        # keys this script made itself: OpenSSL's checks of each (many ms for 10,000 keys) are skipped
        key._private_key = serialization.load_der_private_key(der, None, unsafe_skip_rsa_key_validation=True)
        out.append(key)
    return out


@dataclass(frozen=True)
class Sim:
    """One simulated server: its identity and what the broker placed it on."""

    validator: RSASignatureValidator
    peer_id: str
    gpu: tuple[str, int, float, float]
    info: PeerInfo


def make_servers(keys: list[RSAPrivateKey], seed: int = 0) -> tuple[list[Sim], dict[str, Any]]:
    rng = random.Random(seed)
    sims = []
    for key in keys:
        validator = RSASignatureValidator(key)
        peer_id = owner_of(validator.local_public_key)
        assert peer_id is not None
        gpu = rng.choices(GPUS, weights=[g[2] for g in GPUS])[0]
        memory = int(gpu[1] * 0.85 * 2**30)
        info = PeerInfo(peer_id, 0.5 * gpu[3] * rng.uniform(0.8, 1.2), memory)
        sims.append(Sim(validator, peer_id, gpu, info))
    started = time.perf_counter()
    plan = plan_swarm([s.info for s in sims], BLOCKS, BLOCK_BYTES, Policy())
    seconds = time.perf_counter() - started
    placed = [Sim(s.validator, s.peer_id, s.gpu, _settled(s.info, plan.placements.get(s.peer_id))) for s in sims]
    return placed, {"first_plan_s": seconds, "mean_span": _mean_span(placed)}


def _settled(info: PeerInfo, placement: Any) -> PeerInfo:
    if placement is None:
        return info
    return PeerInfo(info.peer_id, info.throughput, info.memory, None, placement.span, placement.role)


def _mean_span(sims: list[Sim]) -> float:
    spans = [len(s.info.span) for s in sims if s.info.span is not None]
    return sum(spans) / max(len(spans), 1)


def server_record(s: Sim, model_id: str, rng: random.Random) -> ServerRecord:
    assert s.info.span is not None
    ip = f"{rng.randint(11, 220)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
    span, online = s.info.span, s.info.role == Role.SERVE
    return ServerRecord(
        peer_id=s.peer_id,
        maddrs=(f"/ip4/{ip}/tcp/31337/p2p/{s.peer_id}", f"/ip4/{ip}/udp/31337/quic/p2p/{s.peer_id}"),
        state=PeerState.ONLINE if online else PeerState.STANDBY,
        start=span.start,
        end=span.end,
        model_id=model_id,
        num_blocks=BLOCKS,
        fingerprint=FINGERPRINT,
        dtype="bfloat16",
        device=s.gpu[0],
        device_memory=s.gpu[1] * 2**30,
        forward_tps=round(s.info.throughput * 400 / len(span), 3),
        inference_sps=round(s.info.throughput * 20 / len(span), 3),
        cache_tokens_free=rng.randint(0, 200_000),
        cache_tokens_total=200_000,
        open_sessions=rng.randint(0, 8),
        software_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        requests_served=rng.randint(0, 10**6),
        direct_address=f"{ip}:31338",
        network_mbps=rng.choice([100.0, 500.0, 1000.0]),
        reached="public",
    )


FINGERPRINT = "9f2c" * 16


def peer_record(s: Sim, now: float) -> PeerRecord:
    span, role = s.info.span, s.info.role
    return PeerRecord(
        peer_id=s.peer_id,
        state=PeerState.ONLINE if role == Role.SERVE else PeerState.STANDBY,
        start=span.start if span else None,
        end=span.end if span else None,
        block_throughput=s.info.throughput,
        memory=s.info.memory,
        block_bytes=BLOCK_BYTES,
        max_blocks=s.info.memory // BLOCK_BYTES,
        updated_at=now,
        network_mbps=500.0,
        token_bytes=16384,
    )


def signed_item(validator: RSASignatureValidator, key: str, record: Record, expiration: float) -> tuple[Any, ...]:
    """(key id, subkey, signed value bytes, expiration) exactly as a store by the record's author sends it."""
    key_id, subkey = DHTID.generate(source=key), validator.local_public_key
    value = MSGPackSerializer.dumps(record.to_wire())
    dht_record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration)
    return key_id, subkey, validator.sign_value(dht_record), expiration
