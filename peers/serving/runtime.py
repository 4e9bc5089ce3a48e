"""What the server's RPC code needs of the thing that runs a span: the execution-plane interface.

Two runtimes implement it: ``peers.blocks.backend.SpanBackend`` (PyTorch: inference, forward, backward, adapters) and
``peers.blocks.onnx_runtime.OnnxSpan`` (ONNX Runtime on CPU, Llama-family blocks: inference and forward). A peer
announces its runtime and capabilities in its ``ServerRecord``, so routes that need a capability skip servers
without it; a request that needs one anyway (sent by a buggy or hostile client) gets ``BadInputError`` from
``require`` before any compute."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import PretrainedConfig

from peers.serving.adapters import Adapter
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.records import Capability

RUNTIMES = ("torch", "onnx")


class SpanRuntime(Protocol):
    """A span of decoder blocks, ready to run requests (one object per loaded span).

    ``run`` takes and returns torch tensors whatever runs inside, so the RPC code, the wire format and the checks
    are the same for every runtime. A KV cache is whatever ``new_cache`` returns: opaque to the caller, handed back
    to ``run`` of the same runtime with ``past``, the tokens it already holds (the server's session counts them)."""

    name: str  # "torch" or "onnx": announced in the peer's record
    capabilities: frozenset[Capability]
    config: PretrainedConfig
    span: Span
    device: torch.device
    dtype: torch.dtype

    @property
    def linears(self) -> Mapping[str, tuple[int, int]]:
        """LoRA's possible targets in one block: module path -> (in, out) features (empty without adapters)."""
        ...

    def new_cache(self, max_length: int | None = None) -> object:
        """An empty KV cache for one inference session of at most ``max_length`` positions."""
        ...

    def run(
        self,
        hidden: torch.Tensor,
        sub: Span,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        past: int = 0,
        adapter: Adapter | None = None,
    ) -> torch.Tensor:
        """Blocks ``sub`` (inside ``span``) over ``hidden`` [batch, n, hidden]: ``attention_mask`` [batch, past + n]
        of 0/1, ``position_ids`` [batch, n] (default: ``past`` onwards), ``cache`` updated in place when given."""
        ...

    def weight_tensors(self) -> list[torch.Tensor]:
        """Torch tensors that hold the span's weights (not counted as memory a kept autograd graph adds)."""
        ...


@dataclass(frozen=True)
class Row:
    """One session's step in a batch: ``hidden`` [b, n, hidden] entering with ``past`` tokens in ``cache``;
    ``mask`` [b, past + n] of 0/1 and ``pos`` [b, n] as the client sent them (None: no padding, positions from
    ``past``)."""

    hidden: torch.Tensor
    cache: object  # the session's DynamicCache (``batchable``)
    past: int
    mask: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    adapter: Adapter | None = None

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])


@runtime_checkable
class Batcher(Protocol):
    """A runtime that runs several sessions' steps as one forward (the torch runtime: ``peers.blocks.batched``)."""

    def joins(self, cache: object) -> bool:
        """Whether a session with ``cache`` can step in a batch (its layout is one a batch reproduces exactly)."""
        ...

    def run_batch(self, rows: list[Row], sub: Span) -> list[torch.Tensor]:
        """Every row's output, each row's cache updated as if it had stepped alone."""
        ...


def require(runtime: SpanRuntime, capability: Capability, what: str) -> None:
    """Refuse a request whose ``what`` needs a capability this peer's runtime lacks (the peer stays up)."""
    if capability not in runtime.capabilities:
        has = ", ".join(sorted(runtime.capabilities))
        raise BadInputError(
            f"{what} needs the {capability.value!r} capability, which this server's {runtime.name} runtime lacks "
            f"(it has: {has}); route this request to a server whose record lists {capability.value!r}"
        )
