"""The ONNX runtime (``peers.serving.runtime.SpanRuntime``): Llama-family blocks run by ONNX Runtime's CPU provider,
one session per block (so a client may enter the span at any block), exported once by ``peers.blocks.onnx_export``.

It serves inference sessions and plain forward passes; it has no autograd and no adapter hooks, so a backward, a
forward kept for one, or a request carrying an adapter is refused with ``BadInputError`` (by ``require``, in the RPC
code and again here). The KV cache of a session holds each block's present key and value as numpy arrays, replaced
by the block's outputs at every step; the rotary tables and the additive attention mask (causal, sliding where the
block is, and the client's padding) are computed here in torch and passed in."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import PretrainedConfig

from peers.blocks.onnx_export import GRAPH_DTYPES, head_dim
from peers.serving.adapters import Adapter
from peers.serving.runtime import require
from swarm.errors import BadInputError
from swarm.families.spec import Family
from swarm.ids import Span
from swarm.records import Capability

log = logging.getLogger(__name__)


class OnnxCache:
    """One inference session's keys and values: block index -> (key, value) [batch, kv_heads, tokens, head_dim]."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def session_options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(threads, 1)  # the peer's --threads, as torch gets: peers often share a machine
    opts.inter_op_num_threads = 1  # one block is a chain of ops: nothing to run side by side
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle worker threads would spin for work and take cores from the other peers and processes of the machine.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3  # errors only
    return opts


class OnnxSpan:
    name = "onnx"
    capabilities = frozenset({Capability.INFERENCE, Capability.FORWARD})

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        span: Span,
        graphs: list[Path],
        threads: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype``: the graphs' (``onnx_export.GRAPH_DTYPES``): what hidden states, tables, masks and caches are
        given in."""
        if len(graphs) != len(span):
            raise ValueError(f"{len(graphs)} graphs for the {len(span)} blocks of {span}")
        self.config = config
        self.span = span
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.np_dtype = GRAPH_DTYPES[dtype][0]
        rotary = family.new_rotary("cpu")  # weightless: the same tables as the torch runtime's
        if rotary is None:
            raise BadInputError(f"the ONNX runtime serves rotary families, not {family.label}")
        self.rotary = rotary
        self.sliding = [family.layer_kind(i) == "sliding_attention" for i in span]
        window = getattr(config, "sliding_window", None)
        self.window = int(window) if window else None
        self.kv_heads, self.head_dim = int(config.num_key_value_heads), head_dim(config)
        opts = session_options(threads)
        self.sessions = [ort.InferenceSession(str(g), opts, providers=["CPUExecutionProvider"]) for g in graphs]

    @property
    def linears(self) -> Mapping[str, tuple[int, int]]:
        return {}  # no adapters here

    def new_cache(self, max_length: int | None = None) -> OnnxCache:
        return OnnxCache()

    def weight_tensors(self) -> list[torch.Tensor]:
        return []  # the weights live in ONNX Runtime's sessions, not in torch tensors

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
        """Blocks ``sub`` (inside this span) over ``hidden`` [batch, n, hidden]; ``past`` tokens already cached."""
        if adapter is not None:
            require(self, Capability.ADAPTERS, "a request with an adapter (LoRA or prompts)")
        if hidden.requires_grad and torch.is_grad_enabled():
            require(self, Capability.BACKWARD, "a forward pass with gradients")
        if cache is not None and not isinstance(cache, OnnxCache):  # a cache made by another runtime
            raise TypeError(f"the onnx runtime takes an OnnxCache, not {type(cache).__name__}")
        if sub not in self.span:
            raise ValueError(f"blocks {sub} are not in this span {self.span}")
        batch, n = hidden.shape[:2]
        with torch.no_grad():
            hidden = hidden.detach().to("cpu", self.dtype)
            if position_ids is None:
                position_ids = torch.arange(past, past + n).unsqueeze(0).expand(batch, -1)
            cos, sin = self.rotary(hidden, position_ids.to("cpu"))
        if cos.shape[-1] != self.head_dim:  # a partial rotary embedding: not this graph's math
            raise ValueError(f"rotary tables of width {cos.shape[-1]} for heads of {self.head_dim}")
        half = self.head_dim // 2  # transformers' tables repeat their first half (rotate_half): the graph takes one
        feeds: dict[str, np.ndarray] = {
            "cos": np.ascontiguousarray(cos[..., :half].to(self.dtype).numpy()),
            "sin": np.ascontiguousarray(sin[..., :half].to(self.dtype).numpy()),
        }
        local = range(sub.start - self.span.start, sub.end - self.span.start)
        masks = {kind: self._mask(attention_mask, batch, n, past, kind) for kind in {self.sliding[i] for i in local}}
        x = np.ascontiguousarray(hidden.numpy())
        for i in local:
            block = self.span.start + i
            key, value = self._past(cache, block, batch, past)
            feeds.update(hidden=x, mask=masks[self.sliding[i]], past_key=key, past_value=value)
            x, present_key, present_value = self.sessions[i].run(None, feeds)
            if isinstance(cache, OnnxCache):
                cache.blocks[block] = (present_key, present_value)
        return torch.from_numpy(x)

    def _past(self, cache: OnnxCache | None, block: int, batch: int, past: int) -> tuple[np.ndarray, np.ndarray]:
        """The block's cached keys and values of the first ``past`` tokens (the session's count is the truth: a
        step that failed on a later block left this one a step ahead, and it is simply recomputed)."""
        held = cache.blocks.get(block) if cache is not None else None
        if held is None:
            if past:
                raise ValueError(f"block {block} holds no cache for the {past} tokens before this step")
            empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=self.np_dtype)
            return empty, empty
        key, value = held
        if key.shape[0] != batch or key.shape[2] < past:
            raise ValueError(f"block {block} caches {list(key.shape)}, a step needs batch {batch} and {past} tokens")
        if key.shape[2] > past:
            key, value = np.ascontiguousarray(key[:, :, :past]), np.ascontiguousarray(value[:, :, :past])
        return key, value

    def _mask(self, attention_mask: torch.Tensor | None, batch: int, n: int, past: int, sliding: bool) -> np.ndarray:
        """[batch, 1, n, past + n]: 0 where query i (at cache index past + i) may see key j, the dtype's lowest value
        elsewhere (not -inf: a row with every key masked, a padding position, stays finite):
        keys after it, keys a sliding window has passed, and the client's padding."""
        total = past + n
        q = torch.arange(past, total).unsqueeze(1)
        k = torch.arange(total).unsqueeze(0)
        seen = k <= q
        if sliding and self.window is not None:
            seen &= q - k < self.window  # transformers' sliding_window_overlay
        allowed = seen.expand(batch, 1, n, total)
        if attention_mask is not None:
            allowed = allowed & attention_mask.to("cpu").bool()[:, None, None, :]
        mask = torch.zeros(batch, 1, n, total, dtype=self.dtype)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min).numpy()
