"""A private swarm on loopback (real DHT processes and p2pd, no mocks): members started with the same
``--swarm-key`` share records; a peer without the key, with another key, or with a key against an open swarm is
told so at start (``NotMemberError``); and an outsider running the same code that does connect to a member can
neither read nor write anything there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from swarm.dht import RecordStore, dht_time, start_dht
from swarm.errors import NotMemberError
from swarm.membership import SwarmKey
from swarm.owned_dht import OwnedDHT
from swarm.records import TrainerProgress

KEY = "private-swarm-test"


# Run inside a DHT process (module level, defined before any DHT forks): one peer's raw DHT calls to another,
# bypassing routing, as an outsider who knows a member's address would make them. None: the peer gave no answer.
async def _find_at(_dht: object, node: Any, peer: str, key: str) -> bool | None:
    found = await node.protocol.call_find(PeerID.from_base58(peer), [DHTID.generate(source=key)])
    return None if found is None else any(value is not None for value, _ in found.values())


async def _store_at(_dht: object, node: Any, peer: str, key: str) -> list[bool] | None:
    value = MSGPackSerializer.dumps("planted")
    result = await node.protocol.call_store(
        PeerID.from_base58(peer), [DHTID.generate(source=key)], [value], get_dht_time() + 60
    )
    return None if result is None else list(result)  # a protobuf repeated field does not pickle


def call(dht: Any, fn: Any, **kwargs: Any) -> Any:
    return dht.run_coroutine(partial(fn, **kwargs), return_future=True).result(30)  # never hang the test


def address(store: RecordStore) -> tuple[str, ...]:
    return tuple(m if "/p2p/" in m else f"{m}/p2p/{store.peer_id}" for m in store.visible_maddrs())


@contextlib.contextmanager
def stores() -> Iterator[list[Any]]:
    """Every DHT a test starts goes in here and is shut down at its end, whatever happens."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for store in started:
            store.shutdown()


@pytest.fixture
def key(tmp_path: Path) -> SwarmKey:
    return SwarmKey.create(tmp_path / "swarm.key")


def test_members_share_records_and_outsiders_are_refused_at_start(key: SwarmKey, tmp_path: Path):
    with stores() as started:
        first = start_dht(swarm_key=key)
        started.append(first)
        member = start_dht(initial_peers=address(first), swarm_key=SwarmKey.load(tmp_path / "swarm.key"))
        started.append(member)
        assert member.swarm_key == key
        record = TrainerProgress(trainer=first.peer_id, step=3, samples=7, updated=dht_time())
        assert first.publish(KEY, record, dht_time() + 60)
        assert member.read(KEY, TrainerProgress) == [record]

        with pytest.raises(NotMemberError, match="private swarm.*--swarm-key FILE"):
            started.append(start_dht(initial_peers=address(first)))
        wrong = SwarmKey.create(tmp_path / "wrong.key")
        with pytest.raises(NotMemberError, match="refused this peer's key: --swarm-key .*wrong.key"):
            started.append(start_dht(initial_peers=address(first), swarm_key=wrong))
        with pytest.raises(NotMemberError, match="refused"):  # a client too
            started.append(start_dht(initial_peers=address(member), client_mode=True, swarm_key=wrong))


def test_a_keyed_peer_is_told_when_the_swarm_is_open(key: SwarmKey):
    with stores() as started:
        open_peer = start_dht()
        started.append(open_peer)
        with pytest.raises(NotMemberError, match="open swarm.*without --swarm-key"):
            started.append(start_dht(initial_peers=address(open_peer), swarm_key=key))


def test_an_outsider_connected_to_a_member_sees_and_plants_nothing(key: SwarmKey):
    with stores() as started:
        first = start_dht(swarm_key=key)
        started.append(first)
        member = start_dht(initial_peers=address(first), swarm_key=key)
        started.append(member)
        assert first.publish(
            KEY, TrainerProgress(trainer=first.peer_id, step=1, samples=1, updated=dht_time()), dht_time() + 60
        )
        # the same code, without the key, told to go on although nobody answers its pings: its p2pd is connected
        outsider = OwnedDHT(
            initial_peers=list(address(first)),
            start=True,
            ensure_bootstrap_success=False,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
        started.append(outsider)

        # the same raw calls: a member's are answered (so the outsider's failing is the key, not the call)
        assert call(member.dht, _find_at, peer=first.peer_id, key=KEY) is True
        assert call(member.dht, _store_at, peer=first.peer_id, key="member-key") == [True]
        assert call(outsider, _find_at, peer=first.peer_id, key=KEY) is None
        assert call(outsider, _store_at, peer=first.peer_id, key="planted-key") is None
        assert outsider.get(KEY, latest=True) is None
        assert first.dht.get("planted-key", latest=True) is None
        assert first.dht.get("member-key", latest=True) is not None


@pytest.mark.slow
def test_an_outsider_of_a_private_swarm_runs_nothing_on_either_plane(tiny_models, tmp_path: Path):
    """Real servers of a private swarm; a member client generates as Hugging Face does. A client without the key is
    refused at start. An outsider process (``attacker outsider``: the same code, its own identity and DHT) without
    the key, and another with a key of its own, is refused at the DHT, sees no server, and every RPC it sends to a
    server whose addresses leaked (forward and session, over libp2p and the direct plane, info) is refused as
    ``NotMemberError``; the server's counters show nothing ran."""
    import json
    import subprocess
    import sys

    import torch

    from swarm.hop import Hop
    from tests.helpers.models import local_reference
    from tests.helpers.swarms import connect, running_swarm

    key_file, stranger_key = tmp_path / "swarm.key", tmp_path / "other.key"
    SwarmKey.create(key_file)
    SwarmKey.create(stranger_key)
    folder = str(tiny_models["llama"])
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = local_reference(tiny_models["llama"]).generate(prompt, **gen)
    with running_swarm(folder, ["0:4"], "--swarm-key", str(key_file)) as swarm:
        with pytest.raises(NotMemberError, match="--swarm-key"):
            connect(folder, swarm)
        client = connect(folder, swarm, swarm_key=key_file)
        try:
            assert torch.equal(client.generate(prompt, **gen), expected)
            hop: Hop = client.route[0]
            conn = client.connection
            before = conn.loop.run(conn.remote.info(hop, 10.0)).stats
            leaked = json.dumps(
                dict(peer_id=hop.peer_id, start=hop.start, end=hop.end, maddrs=list(hop.maddrs), direct=hop.direct)
            )
            for own_key in ([], ["--swarm-key", str(stranger_key)]):
                cmd = [
                    sys.executable,
                    "-m",
                    "tests.helpers.attacker",
                    "outsider",
                    "--initial-peers",
                    *swarm.initial_peers,
                    "--model-id",
                    Path(folder).name,
                    "--num-blocks",
                    "4",
                    "--hop",
                    leaked,
                    *own_key,
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
                assert done.returncode == 0, done.stderr[-3000:]
                report = json.loads(done.stdout.strip().splitlines()[-1])
                assert report["join"].startswith("NotMemberError"), report
                assert report["servers_seen"] == 0
                for call in ("forward_never", "forward_always", "session_never", "session_always", "info"):
                    assert report[call].startswith("NotMemberError"), (call, report[call])
            after = conn.loop.run(conn.remote.info(hop, 10.0)).stats
            assert {k: after.get(k, 0) for k in ("forward", "sessions")} == {
                k: before.get(k, 0) for k in ("forward", "sessions")
            }
            assert torch.equal(client.generate(prompt, **gen), expected)
        finally:
            client.close()
