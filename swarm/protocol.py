"""Request/response messages shared by client and server, and the RPC names.

Every request carries ``protocol_version``; a server refuses another version with a clear error. Tensors travel
beside the metadata (see ``swarm.wire``) under names; per-client extras that later work adds (adapters, prompts,
trainable-weight gradients) travel the same way, as further named tensors plus fields in ``extras``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1

RPC_FORWARD = "swarm.forward"  # unary: small forward or backward
RPC_FORWARD_STREAM = "swarm.forward_stream"  # streamed: the same, for messages over one frame
RPC_INFERENCE = "swarm.inference"  # bidirectional stream: one session, one step per message group
RPC_COMPUTE_LOOP = "swarm.compute_loop"  # direct TCP only: forward/backward requests back to back on one connection
RPC_INFO = "swarm.info"  # unary: the server's live stats
RPC_BANDWIDTH = "swarm.bandwidth"  # streamed: swallows a payload and says how much arrived (link estimates)


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AdapterRef(_Msg):
    """A client's trainable extras for the requested blocks (LoRA pairs, deep prompts), by content version.

    With ``has_tensors`` the request carries them as named tensors (``lora.{block}.{module}.A``/``.B``,
    ``deep.{block}``) and the server caches them for this client; without, the server uses its cached copy of that
    version or answers ``adapter_missing`` so the client resends. ``client`` is a random 256-bit token: the only key
    to the cache, so no other client can reach these tensors."""

    client: str = Field(min_length=32, max_length=128)
    version: int = Field(ge=0)
    has_tensors: bool
    scaling: float = 1.0  # LoRA: alpha / r


class TrainTag(_Msg):
    """On a pre-training run's requests: the global step the trainer is in, and (backward) how many samples the
    micro-batch holds, which the stage counts toward the global batch."""

    step: int = Field(ge=0)
    samples: int = Field(default=0, ge=0)


class ComputeRequest(_Msg):
    """A forward or backward over blocks ``start:end`` (which the server must hold).

    Tensors: ``hidden`` [batch, seq, hidden]; optional ``attention_mask`` [batch, seq] (1 = real token),
    ``position_ids`` [batch, seq]; for backward ``grad_output`` and, if the server may have dropped the forward,
    ``hidden`` again to recompute it. A backward's reply holds ``grad_input`` and, for each adapter tensor the
    forward used, ``grad.{its name}``.
    """

    protocol_version: int = PROTOCOL_VERSION
    # release: drop this client's cached adapter; state: a trainable stage's weights and optimizer state (for a joining
    # replica, or an export); step: a trainer says global step ``train.step`` has begun. None of these uses start/end.
    kind: Literal["forward", "backward", "release", "state", "step"]
    start: int
    end: int
    keep_for_backward: bool = False  # forward: hold the graph so a backward needs no recompute
    forward_id: str | None = None  # forward: the name to keep it under; backward: which forward
    adapter: AdapterRef | None = None
    input_grad: bool = True  # backward: False when nobody needs the gradient of ``hidden`` (a frozen first hop)
    train: TrainTag | None = None
    extras: dict[str, Any] = Field(default_factory=dict)


class OpenSession(_Msg):
    """First message of an inference stream."""

    protocol_version: int = PROTOCOL_VERSION
    session_id: str
    start: int
    end: int
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    adapter: AdapterRef | None = None
    extras: dict[str, Any] = Field(default_factory=dict)


class InferenceStep(_Msg):
    """One step: tensors ``hidden`` [batch, n, hidden] and optional ``attention_mask`` [batch, position + n] and
    ``position_ids`` [batch, n]. ``position`` is how many tokens the client believes the server already holds;
    a mismatch is an error, which keeps replayed histories honest."""

    position: int = Field(ge=0)


class Reply(_Msg):
    ok: bool = True
    error_code: str | None = None
    error: str | None = None
    stats: dict[str, Any] = Field(default_factory=dict)
