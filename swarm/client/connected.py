"""The client model's parts while it is connected to a swarm, built whole by ``connect`` and closed together: the
connection, the remote chain of blocks, the plan runner, the open inference sessions, the procedures and speculative
decoding. ``DistributedModelForCausalLM`` holds them (``None`` once closed) and keeps only its own modules."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from swarm.client.connection import SwarmConnection
from swarm.client.generation import OpenSessions, session_maker
from swarm.client.local_blocks import LocalBlocks
from swarm.client.passes.sequential import RemoteChain
from swarm.client.procedures import Procedures
from swarm.client.runner import ModelParts, PlanRunner
from swarm.client.speculative.speculator import Speculator
from swarm.client.tuning.adapters import AdapterDelivery, ClientAdapters
from swarm.client.verify.trust import Trust
from swarm.config import ClientConfig
from swarm.families.recompute import local_judge
from swarm.families.spec import Family
from swarm.plan.compile import ModelShape, float_dtype
from swarm.protocol import ReleaseRequest


@dataclass(frozen=True)
class Own:
    """What the model brings of its own to its connected parts."""

    modules: ModelParts  # embeddings, prompts, head and loss, as the executor calls them
    config: PretrainedConfig
    dtype: torch.dtype  # the embeddings', in which hidden states travel
    family: Family
    adapters: ClientAdapters | None
    local: LocalBlocks | None  # the first blocks, run on this client (None: every block is remote)
    folder: Path | None  # the model folder it was loaded from (drafters may read it; None: built from parts)


@dataclass(frozen=True)
class Connected:
    conn: SwarmConnection
    blocks: RemoteChain
    runner: PlanRunner
    sessions: OpenSessions
    procedures: Procedures
    speculator: Speculator

    def close(self) -> None:
        self.sessions.close()
        delivery = self.blocks.delivery
        if delivery is not None:  # servers would drop it after Timing.adapter_ttl anyway
            with contextlib.suppress(Exception):
                self.conn.notify(delivery.holders(), ReleaseRequest(client=delivery.adapters.client_id))
            delivery.forget()
        self.conn.close()


def connect(
    own: Own,
    cfg: ClientConfig,
    model_id: str,
    fingerprints: frozenset[str] | None,
    groups: Mapping[str, str] | None,
) -> Connected:
    """Join the swarm serving ``model_id`` (chaining servers of ``fingerprints``; None: the best-covered weights,
    ``groups``: each fingerprint's dtype, as a chain never mixes dtypes) and build the parts over the connection."""
    c = own.config
    dtype = float_dtype(str(own.dtype).removeprefix("torch."))
    shape = ModelShape(model_id, int(c.num_hidden_layers), int(c.hidden_size), int(c.vocab_size), dtype)
    conn = SwarmConnection(
        cfg,
        model_id,
        shape.num_blocks,
        fingerprints,
        groups=groups,
        hidden=shape.hidden_size,
        value_bytes=own.dtype.itemsize,
    )
    try:
        conn.trust = Trust.of(conn, local_judge(own.family, own.folder, cfg.cache_dir))
        adapters = own.adapters
        blocks = RemoteChain(conn, AdapterDelivery(adapters) if adapters and adapters.applies_remotely else None)
        runner = PlanRunner(own.modules, conn, blocks, shape, own.local)
        prompts = adapters.spec.prompt_tokens if adapters is not None else 0
        sessions = OpenSessions(session_maker(runner, prompts))
        procedures = Procedures(runner, sessions, learned_positions=own.family.spec.positions is not None)
        speculator = Speculator(own.family, own.folder, cfg.cache_dir, sessions, procedures.step_new, own.local)
    except BaseException:
        conn.close()
        raise
    return Connected(conn, blocks, runner, sessions, procedures, speculator)
