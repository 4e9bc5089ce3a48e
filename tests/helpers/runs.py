"""The shipped tiny pre-training run, rewritten per test (``write_run``), and what the tests of runs share: loss
curves compared with one process's, a stage's weights read back from a peer, and DHTs on loopback for averaging."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swarm.hop import Hop
from swarm.owned_dht import OwnedDHT
from swarm.training.init import stage_state_bytes

if TYPE_CHECKING:
    from swarm.client.training.trainer import Trainer

SHIPPED = Path(__file__).parents[2] / "configs" / "runs" / "tiny-llama.toml"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_run(folder: Path, **sections) -> Path:
    """The shipped tiny run with some fields replaced: ``write_run(tmp, checkpoint={"every_steps": 5})``."""
    data = tomllib.loads(SHIPPED.read_text())
    data["checkpoint"]["dir"] = str(folder / "checkpoints")
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    lines = [f"{k} = {_toml(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, fields in data.items():
        if isinstance(fields, dict):
            lines += [f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in fields.items()]
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def close_all(ours: list[float], theirs: list[float], tol: float = 1e-5) -> bool:
    return all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(ours, theirs, strict=True))


def stage_state(trainer: Trainer, peer_id: str, stage) -> tuple[int, dict[str, torch.Tensor]]:
    """A stage's step and weights as one peer holds them, over the ``state`` RPC."""
    conn = trainer.model.connection
    record = next(
        r for rs in conn.store.view(trainer.run.model_id, stage.end).values() for r in rs if r.peer_id == peer_id
    )
    limit = stage_state_bytes(trainer.run, stage)
    reply, tensors = conn.loop.run(conn.remote.state(Hop.of(record, stage.start, stage.end), 30.0, limit))
    assert (reply.start, reply.end) == (stage.start, stage.end)
    return reply.step, {k: v for k, v in tensors.items() if k.startswith("param.")}


# Timings for a test's averagers (hivemind's ``DecentralizedAverager`` arguments). A follower whose wait for its
# leader's go ran out on a loaded machine is put in the group by the leader but never joins the round: without part
# timeouts its groupmates waited for its parts until the test gave up (a round hung 45 s in CI). With them the round
# fails after a few seconds without changing anything and every replica retries (``allow_retries``), the three
# together again. Matchmaking's request timeout stays below its period, as hivemind requires against deadlocks.
AVERAGER_TIMINGS = dict(min_matchmaking_time=3.0, request_timeout=2.0, sender_timeout=5.0, reducer_timeout=10.0)


@contextmanager
def dhts(n: int) -> Iterator[list[OwnedDHT]]:
    started: list[OwnedDHT] = []
    try:
        started.append(OwnedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        for _ in range(n - 1):
            addresses = [str(a) for a in started[0].get_visible_maddrs()]
            started.append(OwnedDHT(start=True, initial_peers=addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        yield started
    finally:
        for dht in started:
            dht.shutdown()
