"""The torch runtime (``peers.serving.runtime.SpanRuntime``): runs a span of decoder layers, forward with or without a
KV cache, and backward, with or without a client's adapter (LoRA pairs applied by forward hooks on the linear
modules, deep prompts added to the prompt positions)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle
from transformers import DynamicCache, PretrainedConfig

from peers.blocks import batched
from peers.serving.adapters import Adapter
from peers.serving.runtime import Row
from swarm.errors import BadInputError
from swarm.families import span as family_span
from swarm.families.spec import Family
from swarm.ids import Span
from swarm.records import ALL_CAPABILITIES
from swarm.tuning import linear_modules


class SpanBackend:
    name = "torch"
    capabilities = ALL_CAPABILITIES

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        layers: torch.nn.ModuleList,
        span: Span,
        device: str | torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.family = family
        self.layers = layers
        self.span = span
        self.device = torch.device(device)
        self.dtype = dtype
        # weightless: built here, not loaded (none for learned positions or ALiBi; per layer type for Gemma 3)
        self.rotary = family.new_rotary(self.device)
        self.linears = linear_modules(layers[0]) if len(layers) else {}
        # The adapter of the request being computed. A context variable, not an attribute: small inference steps run
        # on the RPC loop's thread while the compute thread may be running another client's request.
        self._active: ContextVar[Adapter | batched.RowAdapters | None] = ContextVar("adapter", default=None)
        # Hooks exist only while some request with LoRA runs: a hooked module takes torch's slow call path, which
        # would cost every plain decode step ~1 ms per hop. Counted, since requests overlap (see _active).
        self._hooked = [
            (module, (span.start + i, path))
            for i, layer in enumerate(layers)
            for path, module in layer.named_modules()
            if path in self.linears
        ]
        self._hook_handles: list[RemovableHandle] = []
        self._hook_users = 0
        self._hook_lock = threading.Lock()

    def _hooks(self, on: bool) -> None:
        with self._hook_lock:
            self._hook_users += 1 if on else -1
            if on and self._hook_users == 1:
                self._hook_handles = [m.register_forward_hook(self._lora_hook(key)) for m, key in self._hooked]
            elif not on and self._hook_users == 0:
                for handle in self._hook_handles:
                    handle.remove()
                self._hook_handles = []

    def _lora_hook(
        self, key: tuple[int, str]
    ) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor | None]:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            adapter = self._active.get()
            if isinstance(adapter, batched.RowAdapters):  # a batch of sessions: each row its own adapter's delta
                return adapter.delta(key, args[0], output)
            pair = adapter.lora.get(key) if adapter is not None else None
            if adapter is None or pair is None:
                return None
            a, b = pair
            return output + F.linear(F.linear(args[0], a), b) * adapter.scaling

        return hook

    def joins(self, cache: object) -> bool:
        return batched.batchable(cache)

    def run_batch(self, rows: list[Row], sub: Span) -> list[torch.Tensor]:
        """Several sessions' steps of the same number of tokens through blocks ``sub`` as one forward; each row's
        output, and each row's cache updated as if it had stepped alone (``peers.blocks.batched``)."""
        if any(r.adapter is not None and r.adapter.prompt_tokens and r.past < r.adapter.prompt_tokens for r in rows):
            raise BadInputError("a step inside deep prompts' positions cannot join a batch")  # the scheduler's bug
        batch = batched.assemble(rows, sub, self.device)
        before = batched.lengths(rows, sub)
        adapters = batched.rows_adapters(rows)
        token = self._active.set(adapters)
        if adapters is not None:
            self._hooks(True)
        try:
            out = self._layers(batch.hidden, sub, batch.mask, batch.pos, batch.cache, batch.past, None)
        except BaseException:
            batched.undo(rows, sub, before)  # the rows' caches as they were: each can run again alone
            raise
        finally:
            if adapters is not None:
                self._hooks(False)
            self._active.reset(token)
        return list(torch.split(out, [r.rows for r in rows]))

    def new_cache(self, max_length: int | None = None) -> DynamicCache:
        return family_span.new_cache(self.family, max_length)

    def weight_tensors(self) -> list[torch.Tensor]:
        rotary = [*self.rotary.buffers()] if self.rotary is not None else []
        return [*self.layers.parameters(), *self.layers.buffers(), *rotary]

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
        if cache is not None and not isinstance(cache, DynamicCache):  # a cache made by another runtime
            raise TypeError(f"the torch runtime takes a DynamicCache, not {type(cache).__name__}")
        lora = adapter is not None and bool(adapter.lora)
        token = self._active.set(adapter)
        if lora:
            self._hooks(True)
        try:
            return self._layers(hidden, sub, attention_mask, position_ids, cache, past, adapter)
        finally:
            if lora:
                self._hooks(False)
            self._active.reset(token)

    def _layers(
        self,
        hidden: torch.Tensor,
        sub: Span,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: DynamicCache | None,
        past: int,
        adapter: Adapter | None,
    ) -> torch.Tensor:
        hidden = hidden.to(self.device)
        n = hidden.shape[1]
        if position_ids is not None:
            position_ids = position_ids.to(self.device)
        indices = range(sub.start, sub.end)
        # positions, masks by layer type, rotary tables, ALiBi: what the family's model computes around its layers
        inputs = family_span.span_inputs(
            self.family,
            self.rotary,
            hidden,
            indices,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            past=past,
        )
        prompts = adapter.prompt_tokens if adapter is not None else 0
        if prompts and past == 0 and n < prompts:
            raise BadInputError(f"deep prompts of {prompts} tokens need at least that many positions, got {n}")
        if prompts and 0 < past < prompts:
            raise BadInputError(f"a step at position {past} falls inside the deep prompts' {prompts} positions")
        deeps = adapter.deep if adapter is not None and prompts and past == 0 else {}
        for index in indices:
            deep = deeps.get(index)
            if deep is not None:  # the prompt positions of this block's input get the block's own prompt added
                hidden = torch.cat([hidden[:, :prompts] + deep.to(hidden.dtype), hidden[:, prompts:]], dim=1)
            layer = self.layers[index - self.span.start]
            hidden = family_span.call_layer(self.family, layer, index, hidden, inputs, cache)
        return hidden
