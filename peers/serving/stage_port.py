"""What a peer serves: a stage object the node is handed, so the node itself never asks which kind it runs. This
module is the port (``Stage``, with what it may use of the peer, ``StageEnv``); the stages themselves are:

- ``peers.blocks.serving_stage.ServingStage``: frozen weights of a model card, read from safetensors; the broker
  spreads peers over the blocks (``peers.broker.planner``).
- ``peers.training.trainable_stage.TrainableStage``: a pre-training run's stage, whose weights learn; the broker
  balances peers over the run's fixed stages.

A stage knows its model, loads a span (``load``), plans placements when its peer is the broker (``plan``), and may
add background work and RPC handlers of its own (``peers.serving.ports``)."""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PretrainedConfig

from peers.broker.planner import PeerInfo, PlacementPlan, Policy
from peers.serving.engine import Engine
from peers.serving.ports import Learner, TrainingRpc
from peers.serving.runtime import SpanRuntime
from swarm.config import Timing
from swarm.dht import RecordStore
from swarm.families.spec import Family
from swarm.ids import Span
from swarm.rpc.remote import Remote
from swarm.verdict import Local

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What a peer knows of the model it serves."""

    name: str  # its id in the DHT
    config: PretrainedConfig
    family: Family
    dtype: torch.dtype
    fingerprint: str
    block_bytes: int  # the largest block, as this peer holds it (quantized: in its format)
    quantization: str = "none"  # swarm.quantization: the format of its linear weights
    # fingerprints of servers it chains with (pushes to, takes pushes from): its own weights and dtype in every
    # format, since a client that allowed them may route through them (empty: its own fingerprint only)
    chains_with: frozenset[str] = frozenset()
    revision: str | None = None  # the Hub commit, for a model named by its Hub name (``swarm.hub_snapshot``)

    @property
    def chain_fingerprints(self) -> frozenset[str]:
        return self.chains_with | {self.fingerprint}

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_bytes(self) -> int:
        """Bytes one token's hidden state takes on the wire."""
        return int(self.config.hidden_size) * self.dtype.itemsize


@dataclass(frozen=True)
class StageEnv:
    """What a stage may use of the peer that runs it."""

    store: RecordStore
    remote: Remote
    peer_id: str
    compute: Engine  # the compute thread a stage's own work runs on (``run``, ``in_background``)
    timing: Timing


class Stage(Protocol):
    model: ModelInfo

    def attach(self, env: StageEnv) -> None:
        """Called once the peer's DHT, transport and compute exist, before the first ``load``."""

    def check_pinned(self, span: Span) -> None:
        """Refuse a ``--blocks`` span this stage cannot serve."""

    async def load(self, span: Span) -> tuple[SpanRuntime, Learner | None]:
        """The span's layers in the peer's runtime, ready to serve (and its learner, for trainable weights)."""

    def probe(self) -> SpanRuntime:
        """One block to measure this peer's speed on before the broker places it (blocking)."""

    def plan(self, peers: list[PeerInfo], policy: Policy) -> PlacementPlan:
        """The broker's placement of ``peers`` (pure)."""

    def background(self) -> list[Coroutine[object, None, None]]:
        """Work that runs as long as the peer does."""

    def local_judge(self) -> Local | None:
        """This peer's own run of a span of the model's weights, to judge accusations by (None: it has none)."""

    @property
    def training(self) -> TrainingRpc | None:
        """Handlers of state requests and step notices, for trainable stages."""

    def close(self) -> None: ...
