"""The malicious participant's attacks on pre-training (``tests.helpers.attacker`` runs them): poisoned requests
to a run's first stage, and hivemind's own averager trying to join the replicas' averaging."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from swarm.dht import RecordStore, dht_time
from swarm.errors import BusyError, SwarmError
from swarm.hop import Hop
from swarm.owned_dht import die_with_parent
from swarm.protocol import RPC_FORWARD, BackwardRequest, ForwardRequest, Reply, StepNotice, TrainTag
from swarm.records import TrainerProgress
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote


def errors_of(
    loop: LoopThread, remote: Remote, hop: Hop, calls: list[tuple[str, Any, dict[str, torch.Tensor]]]
) -> dict[str, str]:
    """Each call's outcome: "ok", or the error class the server answered with (and its message)."""
    out: dict[str, str] = {}
    for name, request, tensors in calls:
        try:
            loop.run(remote.call(hop, RPC_FORWARD, request, tensors, 30.0, Reply))
            out[name] = "ok"
        except SwarmError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def attack_training(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """Against the first stage of a pre-training run: poisoned backward passes (NaN, overflowing and miscounted),
    steps far ahead, step notices without a trainer's signature or with its name forged, and forged progress."""
    store = stores[0]
    view = store.view(args.model_id, args.num_blocks)
    target = next(r for r in view[0] if r.peer_id != store.peer_id)
    hop = Hop.of(target, target.start, target.end)
    loop = LoopThread("attacker")
    remote = Remote(loop.run(store.replicate_p2p()), store.credentials())
    me, honest, now = store.peer_id, args.honest, dht_time()
    mine = TrainerProgress(trainer=me, step=10**12, samples=1 << 30, updated=now)
    forged = TrainerProgress(trainer=honest, step=10**12, samples=1 << 30, updated=now)
    # progress in the DHT: its own (a stranger to a closed run) and one in the honest trainer's name
    store.publish(args.trainers_key, mine.model_copy(update={"step": args.step, "samples": 1 << 20}), now + 60)
    store.publish(args.trainers_key, forged, now + 60)
    hidden = torch.randn(8, args.seq_len, args.hidden_size)
    grad = torch.randn(8, args.seq_len, args.hidden_size)

    def fwd(fid: str, tag: TrainTag) -> tuple[str, Any, dict[str, torch.Tensor]]:
        return (
            fid,
            ForwardRequest(start=hop.start, end=hop.end, keep_for_backward=True, forward_id=fid, train=tag),
            {"hidden": hidden},
        )

    def bwd(fid: str, tag: TrainTag, g: torch.Tensor) -> tuple[str, Any, dict[str, torch.Tensor]]:
        request = BackwardRequest(start=hop.start, end=hop.end, forward_id=fid, input_grad=True, train=tag)
        return f"backward {fid}", request, {"grad_output": g}

    as_honest = TrainTag(step=args.step, samples=8, trainer=honest)
    calls = [
        fwd("stranger", TrainTag(step=args.step, samples=8, trainer=me)),
        fwd("nan", as_honest),
        bwd("nan", as_honest, torch.full_like(grad, float("nan"))),
        fwd("overflow", as_honest),
        bwd("overflow", as_honest, grad * 1e37),
        fwd("miscount", as_honest),
        bwd("miscount", as_honest.model_copy(update={"samples": 16}), grad),
        fwd("far ahead", TrainTag(step=10**12, samples=8, trainer=honest, proof=store.sign(mine))),
        fwd("forged proof", TrainTag(step=args.step + 1, samples=8, trainer=honest, proof=store.sign(forged))),
        ("notice", StepNotice(step=10**12, proof=store.sign(mine)), {}),
        ("notice forged", StepNotice(step=10**12, proof=store.sign(forged)), {}),
    ]
    remotes = [remote] + [Remote(loop.run(s.replicate_p2p()), s.credentials()) for s in stores[1:]]
    try:
        answers = errors_of(loop, remote, hop, calls)
        return {"target": target.peer_id, "answers": answers, **state_flood(loop, remotes, hop)}
    finally:
        for r in remotes:
            loop.run(r.p2p.shutdown(), 5.0)
        loop.close(5.0)


def state_flood(loop: LoopThread, remotes: list[Remote], hop: Hop, most: int = 12) -> dict[str, Any]:
    """From each identity, the stage's whole state (weights and Adam moments) over and over, until refused (at most
    ``most`` times): {identity: [each answer]}, and the seconds the flood took."""
    flood: dict[str, list[str]] = {}
    t0 = time.monotonic()
    for r in remotes:
        answers = flood[r.creds.peer_id] = []
        for _ in range(most):
            try:
                loop.run(r.state(hop, 30.0, 1 << 30))
                answers.append("ok")
            except SwarmError as e:
                answers.append(f"{type(e).__name__}: {e}")
                if isinstance(e, BusyError):
                    break
    return {"flood": flood, "flood_seconds": time.monotonic() - t0}


def huge_notice(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """A trainer of the run gone rogue (the attacker holds its key): step notices of step 10^12, signed by itself,
    to every server, three times over."""
    store = stores[0]
    servers = {r.peer_id: r for rs in store.view(args.model_id, args.num_blocks).values() for r in rs}
    loop = LoopThread("attacker")
    remote = Remote(loop.run(store.replicate_p2p()), store.credentials())
    mine = TrainerProgress(trainer=store.peer_id, step=10**12, samples=1 << 30, updated=dht_time())
    notice = StepNotice(step=10**12, proof=store.sign(mine))
    try:
        answers = {
            peer_id: [errors_of(loop, remote, Hop.of(r), [("notice", notice, {})])["notice"] for _ in range(3)]
            for peer_id, r in servers.items()
            if peer_id != store.peer_id
        }
        return {"answers": answers}
    finally:
        loop.run(remote.p2p.shutdown(), 5.0)
        loop.close(5.0)


def join_averaging(stores: list[RecordStore], args: argparse.Namespace) -> dict[str, Any]:
    """hivemind's own averager under the replicas' group prefix, holding garbage of the right shapes, trying to
    average with them until it got into ``--groups`` of their groups, or for ``--seconds``."""
    import multiprocessing as mp

    from hivemind.averaging import DecentralizedAverager

    met = mp.Value("i", 0)  # groups it got into (counted in the averager's own process)

    class Outsider(DecentralizedAverager):  # type: ignore[misc]
        def run(self) -> None:  # its process ends with the attacker's, even when the test kills the attacker
            die_with_parent(self._parent_pid)
            super().run()

        async def _aggregate_with_group(self, group_info: Any, *a: Any, **kw: Any) -> Any:
            with met.get_lock():
                met.value += 1
            return await super()._aggregate_with_group(group_info, *a, **kw)

    # hivemind names its handlers after the averager's class: the attacker's class bears the replicas' class's name
    Outsider.__name__ = Outsider.__qualname__ = "OwnedAverager"
    shapes = json.loads(Path(args.shapes).read_text())
    tensors = [torch.full(shape, 1000.0) for shape in shapes]
    averager = Outsider(
        tensors,
        stores[0].dht,
        start=True,
        prefix=args.prefix,
        target_group_size=8,
        min_group_size=2,
        min_matchmaking_time=1.0,
        request_timeout=0.5,
        allreduce_timeout=5.0,
        client_mode=False,
    )
    rounds, deadline = 0, time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline and met.value < args.groups:
            try:
                if averager.step(timeout=5.0, allow_retries=False):
                    rounds += 1
            except Exception:
                pass
    finally:
        averager.shutdown()
    return {"rounds": rounds, "groups": met.value}
