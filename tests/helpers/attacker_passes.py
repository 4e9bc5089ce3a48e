"""The malicious participant's attack on chained training passes (``tests.helpers.attacker passes`` runs it): pushes
to a pre-training stage for passes nobody asked for, each under a made-up trainer name (the honest trainer's among
them), to hold the stage's room for pushes that come before their request.

Two identities: a stranger with no server record, and one that announces a signed record of the last block before
the target's, with the honest stages' fingerprint (self-claimed, so free) but no ``backward`` capability, so that no
trainer routes through it and no stage takes it for a replica. It is driven by files in ``--control``: the stranger
pushes first and the attack says ``stranger``; once ``go`` exists the other identity pushes twice its share every
second (its kept pushes expire, so this keeps its share full), and says ``pushing`` after the first round; once
``stop`` exists (or ``--seconds`` passed) it lets its record expire (the test's later attacks see only the honest
servers) and reports what it sent."""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from peers.rpc.passes import MAX_EARLY_PER_PUSHER
from swarm import wire
from swarm.dht import RecordStore, dht_time
from swarm.hop import Hop
from swarm.protocol import RPC_PUSH, PassPush
from swarm.records import Capability, ServerRecord, servers
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote
from swarm.rpc.transport import Channel

POLL = 0.1  # seconds between looks at the control folder
RECORD_SECONDS = 4.0  # its record's life, announced again every round (an honest peer's heartbeat, shortened)


def _until(done: Callable[[], bool], deadline: float, what: str) -> None:
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the attacker waited in vain for {what}")
        time.sleep(POLL)


def _push(loop: LoopThread, remote: Remote, channel: Channel, names: list[str], hidden: torch.Tensor) -> int:
    """One push per name, each under a fresh key, as the stage before would push a pass's activation."""
    for name in names:
        push = PassPush(client=name, key=uuid.uuid4().hex)
        loop.run(channel.send(wire.encode(remote.meta(push), {"hidden": hidden})))
    return len(names)


def _say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def _stages(store: RecordStore, args: argparse.Namespace) -> tuple[ServerRecord, ServerRecord] | None:
    """The first stage whose input a pass pushes, and the stage before it, once the DHT shows both."""
    honest = [r for r in servers(store.view(args.model_id, args.num_blocks)).values() if r.peer_id != store.peer_id]
    target = min((r for r in honest if r.start > 0), key=lambda r: r.start, default=None)
    before = next((r for r in honest if target is not None and r.end == target.start), None)
    return (target, before) if target is not None and before is not None else None


def push_passes(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    recorded, stranger = stores
    control, deadline = Path(args.control), time.monotonic() + args.seconds
    _until(lambda: _stages(recorded, args) is not None, deadline, "the run's stages in the DHT")
    target, before = _stages(recorded, args) or (None, None)
    assert target is not None and before is not None
    mine = ServerRecord.model_validate(
        before.model_dump()
        | dict(
            peer_id=recorded.peer_id,
            maddrs=tuple(recorded.visible_maddrs()),
            start=target.start - 1,
            direct_address=None,
            punch_via=(),
            capabilities=frozenset({Capability.INFERENCE}),
        )
    )

    expires = 0.0

    def announced() -> bool:  # stored again until the DHT shows it, as an honest peer announces at every heartbeat
        nonlocal expires
        expires = dht_time() + RECORD_SECONDS
        recorded.announce(mine, expires)
        return recorded.peer_id in servers(recorded.view(args.model_id, args.num_blocks))

    _until(announced, deadline, "its record in the DHT")
    hop = Hop(target.peer_id, target.start, target.end, target.maddrs)
    hidden = torch.zeros(1, 4, args.hidden_size)
    loop = LoopThread("pass-pusher")
    remotes = [Remote(loop.run(s.replicate_p2p()), s.credentials(), "never") for s in (recorded, stranger)]
    try:
        channels = [loop.run(r.open_channel(hop, RPC_PUSH)) for r in remotes]
        names = [args.honest] + [f"made-up-{i}" for i in range(2 * MAX_EARLY_PER_PUSHER - 1)]
        by_stranger = _push(loop, remotes[1], channels[1], names[:4], hidden)
        _say(stranger=by_stranger, target=target.peer_id, attacker=recorded.peer_id)
        _until((control / "go").exists, deadline, "go")
        sent = rounds = 0
        while not (control / "stop").exists() and time.monotonic() < deadline:
            expires = dht_time() + RECORD_SECONDS
            recorded.announce(mine, expires)
            sent += _push(loop, remotes[0], channels[0], names, hidden)
            rounds += 1
            if rounds == 1:
                _say(pushing=sent)
            time.sleep(1.0)
        for channel in channels:
            channel.close()
        time.sleep(max(expires - dht_time(), 0.0) + 0.5)  # no DHT node returns an expired value
        return {"sent": sent, "rounds": rounds, "stranger": by_stranger, "target": target.peer_id}
    finally:
        for r in remotes:
            loop.run(r.p2p.shutdown(), 5.0)
        loop.close(5.0)
