"""Forward and backward requests: validate, bind the client's adapter, run on the single compute thread.

The compute thread is one thread: a device runs one kernel stream anyway, and torch releases the GIL so the RPC
loop stays live. Requests waiting for or running on it are capped per caller and in total (``Quota``), so a flood is
refused at once instead of queueing without bound. A span with trainable weights (a pre-training stage) comes with
a ``Learner``: training requests are admitted by it (brought to the trainer's global step) and the weights'
gradients go to it."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from peers.serving.activations import ActivationStore, Kept, SavedBytes, storages
from peers.serving.adapters import Adapter, AdapterCache, Pin, parse_adapter
from peers.serving.checks import Limits, check_aux, check_finite, check_hidden, check_names, check_sub
from peers.serving.config import ComputeConfig
from peers.serving.counters import PeerMetrics
from peers.serving.limits import Quota
from peers.serving.ports import Learner, Tensors
from peers.serving.runtime import SpanRuntime, require
from peers.serving.scheduler import StepScheduler
from swarm.config import Timing
from swarm.errors import ActivationsGoneError, BadInputError
from swarm.ids import Span
from swarm.protocol import AdapterRef, BackwardRequest, ForwardRequest, ReleaseRequest, TrainTag
from swarm.records import Capability
from swarm.tuning import GRAD_PREFIX, is_adapter_name

log = logging.getLogger(__name__)
T = TypeVar("T")


class ComputeService:
    def __init__(self, limits: Limits, cfg: ComputeConfig, timing: Timing) -> None:
        self.limits = limits
        self.backend: SpanRuntime | None = None
        self.learner: Learner | None = None
        self.serving = False  # a standby holds weights but takes no requests
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.kept = ActivationStore(cfg.max_kept_bytes, cfg.max_caller_kept_bytes, timing.activation_ttl)
        self.adapters = AdapterCache(cfg.max_adapter_bytes, timing.adapter_ttl, per_caller=cfg.max_caller_adapter_bytes)
        self.queued = Quota(
            "queued compute requests", cfg.max_caller_queued, cfg.max_queued, ("--max-caller-queued", "--max-queued")
        )
        self._weights: tuple[SpanRuntime, set[int]] | None = None  # the backend's weight storages (see _exclude)
        self.stats: Counter[str] = Counter()
        self.active = 0  # requests the servicer is processing now (reported by info)
        self.metrics = PeerMetrics()  # requests by kind and outcome, latency, bytes (``--metrics-port``)
        self._tasks: set[asyncio.Task[object]] = set()
        # what runs next on the compute thread: inference steps batched across sessions, fairly, ahead of other work
        self.scheduler = StepScheduler(
            self._on_thread,
            max(1, cfg.max_batch),
            cfg.max_batch_tokens,
            timing.max_step_wait,
            cfg.inline_tokens,
            self.metrics.batch_rows.observe,
            # a batched layer's room, rows x (longest past + new tokens): eight requests' worth of tokens
            max_room=8 * cfg.max_batch_tokens,
            window=cfg.batch_window_ms / 1000,
        )

    def set_backend(self, backend: SpanRuntime, learner: Learner | None = None) -> None:
        """Swap in a newly loaded span. Sessions on blocks the new span lacks end at their next step."""
        self.backend, self.learner = backend, learner

    @property
    def held(self) -> Span | None:
        """The blocks this peer serves requests for now (None while joining or standby)."""
        return self.backend.span if self.backend is not None and self.serving else None

    def close(self) -> None:
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _on_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self, fn: Callable[..., T], *args: object, small: bool = False, caller: str | None = None) -> T:
        """``fn`` on the compute thread, when the scheduler lets it in (after waiting inference steps); a small
        request (a few tokens) inline, where two thread hand-offs would cost more than the compute. A caller's
        request counts toward the queue caps until it is done (``caller`` None: the server's own work, such as a
        trainable stage's catch-up, which no client can multiply)."""
        if caller is not None:
            self.queued.acquire(caller)
        try:
            if small:
                return fn(*args)
            return await self.scheduler.other(fn, *args)
        finally:
            if caller is not None:
                self.queued.release(caller)

    def in_background(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn`` on the compute thread without anyone waiting for it; its failure is logged."""

        def done(task: asyncio.Task[object]) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("background %s failed: %s", getattr(fn, "__name__", fn), task.exception())

        task: asyncio.Task[object] = asyncio.ensure_future(self.run(fn, *args))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(done)

    def sub(self, start: int, end: int) -> Span:
        return check_sub(self.held, start, end, self.limits.num_blocks)

    def bind_adapter(
        self, caller: str, ref: AdapterRef | None, tensors: Tensors, sub: Span
    ) -> tuple[Adapter | None, Pin | None]:
        """The request's adapter: the tensors it carries (then cached for this caller and client), or the cached
        version; pinned in the cache until the holder (request, session or kept graph) releases the pin."""
        if ref is None:
            if any(is_adapter_name(name) for name in tensors):
                raise BadInputError("request carries adapter tensors but no adapter reference")
            return None, None
        assert self.backend is not None
        require(self.backend, Capability.ADAPTERS, "a request with an adapter (LoRA or prompts)")
        if not ref.has_tensors:
            return self.adapters.get(caller, ref, sub)
        limits = self.limits
        adapter = parse_adapter(tensors, sub, self.backend.linears, limits.hidden_size, limits.dtype, ref.scaling)
        bound = self.adapters.put(caller, ref, adapter, sub)
        self.stats["adapter_uploads"] += 1
        return bound

    def release(self, req: ReleaseRequest, caller: str) -> None:
        """The client is done: drop its cached adapter now rather than at the idle timeout (only the caller's own:
        another server on the route knows the client's token, not its identity)."""
        self.adapters.drop(caller, req.client)

    def _exclude(self, adapter: Adapter | None) -> set[int]:
        """Storages a kept graph does not add to memory: the weights (computed once per loaded span) and the
        adapter's cached tensors (counted by the adapter budget)."""
        backend = self.backend
        assert backend is not None
        if self._weights is None or self._weights[0] is not backend:
            self._weights = backend, storages(backend.weight_tensors())
        named = list(adapter.named().values()) if adapter is not None else []
        return self._weights[1] | storages(named)

    def _admit(self, tag: TrainTag | None) -> None:
        if tag is None:
            return
        if self.learner is None:
            raise BadInputError("training request to a peer that holds no trainable stage")
        self.learner.admit(tag)

    # ---- forward --------------------------------------------------------------------------------------------------
    async def forward(self, req: ForwardRequest, tensors: Tensors, caller: str) -> Tensors:
        sub = self.sub(req.start, req.end)
        backend = self.backend
        assert backend is not None  # self.sub raised if nothing is held
        require(backend, Capability.FORWARD, "a forward pass")
        if req.keep_for_backward:
            require(backend, Capability.BACKWARD, "a forward kept for a backward (keep_for_backward)")
        check_names(tensors)
        hidden = check_hidden(tensors, self.limits)
        check_finite(hidden, "hidden")
        mask, pos = check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1], self.limits)
        if req.keep_for_backward and not req.forward_id:
            raise BadInputError("keep_for_backward needs a forward_id")
        _check_samples(req.train, hidden, caller)
        adapter, pin = self.bind_adapter(caller, req.adapter, tensors, sub)
        kept: Kept | None = None
        try:
            if not req.keep_for_backward:
                out = await self.run(self._forward, hidden, sub, mask, pos, adapter, req.train, caller=caller)
                self.stats["forward"] += 1
                return {"hidden": out}
            kept = await self.run(self._forward_kept, hidden, sub, mask, pos, adapter, req.train, caller=caller)
        finally:
            if pin is not None and kept is None:  # the request is done with the adapter (else the kept graph is)
                pin.release()
        # stored on the RPC loop, not the compute thread, so the stores (and the pins they release) change on one thread
        kept.pin = pin
        assert req.forward_id is not None
        if not self.kept.put(caller, req.forward_id, kept):
            self.stats["not_kept"] += 1  # over the caps: the backward gets ActivationsGoneError, the client recomputes
        self.stats["forward"] += 1
        return {"hidden": kept.outputs.detach()}

    def _forward(
        self,
        hidden: torch.Tensor,
        sub: Span,
        mask: torch.Tensor | None,
        pos: torch.Tensor | None,
        adapter: Adapter | None,
        tag: TrainTag | None,
    ) -> torch.Tensor:
        self._admit(tag)
        backend = self.backend
        assert backend is not None
        with torch.inference_mode():
            return backend.run(hidden, sub, attention_mask=mask, position_ids=pos, adapter=adapter)

    def _forward_kept(
        self,
        hidden: torch.Tensor,
        sub: Span,
        mask: torch.Tensor | None,
        pos: torch.Tensor | None,
        adapter: Adapter | None,
        tag: TrainTag | None,
    ) -> Kept:
        """A forward whose graph is kept, with the bytes it saved for backward measured as it runs."""
        self._admit(tag)
        backend = self.backend
        assert backend is not None
        saved = SavedBytes(self._exclude(adapter))
        with torch.enable_grad(), saved.measuring():
            inputs = hidden.detach().requires_grad_(True)
            trainable = adapter.trainable() if adapter is not None else None
            outputs = backend.run(inputs, sub, attention_mask=mask, position_ids=pos, adapter=trainable)
        saved.add(inputs)
        saved.add(outputs)
        return Kept(inputs, outputs, sub, saved.nbytes, trainable)

    # ---- backward -------------------------------------------------------------------------------------------------
    async def backward(self, req: BackwardRequest, tensors: Tensors, caller: str) -> Tensors:
        sub = self.sub(req.start, req.end)
        assert self.backend is not None  # self.sub raised if nothing is held
        require(self.backend, Capability.BACKWARD, "a backward pass")
        check_names(tensors)
        grad = check_hidden(tensors, self.limits, "grad_output")
        check_finite(grad, "grad_output")
        _check_samples(req.train, grad, caller)
        held = self.kept.pop(caller, req.forward_id) if req.forward_id else None
        if held is not None and (held.sub != sub or held.outputs.shape != grad.shape):
            raise BadInputError("grad_output does not match the kept forward pass")
        kept: Kept | _Recompute
        pin: Pin | None = None
        if held is not None:
            kept = held
        else:  # recompute the forward from the inputs the client resent
            if "hidden" not in tensors:
                raise ActivationsGoneError("the forward pass for this backward is gone; resend its inputs")
            hidden = check_hidden(tensors, self.limits)
            check_finite(hidden, "hidden")
            if hidden.shape != grad.shape:
                raise BadInputError("grad_output and hidden differ in shape")
            mask, pos = check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1], self.limits)
            adapter, pin = self.bind_adapter(caller, req.adapter, tensors, sub)
            kept = _Recompute(hidden, mask, pos, sub, adapter)
        try:
            out = await self.run(self._backward, kept, grad, req.input_grad, req.train, caller=caller)
        finally:
            if isinstance(kept, _Recompute) and pin is not None:
                pin.release()
        self.stats["backward"] += 1
        learner = self.learner
        if learner is not None and learner.pending:  # its averaging round and checkpoint run after this reply
            self.in_background(learner.finish_step)
        return out

    def _backward(self, kept: Kept | _Recompute, grad: torch.Tensor, input_grad: bool, tag: TrainTag | None) -> Tensors:
        self._admit(tag)
        try:
            return self._gradients(kept, grad, input_grad, tag)
        except RuntimeError as e:
            if isinstance(kept, Kept) and "modified by an inplace operation" in str(e):
                # an optimizer step changed the weights after this forward: the client recomputes it
                raise ActivationsGoneError("the weights changed since this forward pass; resend its inputs") from None
            raise

    def _gradients(
        self, kept: Kept | _Recompute, grad: torch.Tensor, input_grad: bool, tag: TrainTag | None
    ) -> Tensors:
        backend = self.backend
        assert backend is not None
        with torch.enable_grad():
            if isinstance(kept, _Recompute):
                inputs = kept.hidden.detach().requires_grad_(True)
                adapter = kept.adapter.trainable() if kept.adapter is not None else None
                outputs = backend.run(
                    inputs, kept.sub, attention_mask=kept.mask, position_ids=kept.pos, adapter=adapter
                )
            else:
                inputs, outputs, adapter = kept.inputs, kept.outputs, kept.adapter
            named = adapter.named() if adapter is not None else {}
            learner = self.learner if tag is not None else None
            weights: list[torch.Tensor] = list(learner.params) if learner is not None else []
            wrt = ([inputs] if input_grad else []) + list(named.values()) + weights
            if not wrt:
                raise BadInputError("backward asks for no gradient: no input gradient and no adapter")
            grads = list(torch.autograd.grad(outputs, wrt, grad.to(outputs.device), allow_unused=True))
        if learner is not None and tag is not None:  # a trainable stage: its weights' part of the global batch
            learner.accumulate(grads[len(grads) - len(weights) :], tag.samples, tag.trainer, tag.micro)
            del grads[len(grads) - len(weights) :]
        out: Tensors = {}
        if input_grad:
            first = grads.pop(0)
            assert first is not None
            out["grad_input"] = first.detach()
        for (name, tensor), g in zip(named.items(), grads, strict=True):
            out[GRAD_PREFIX + name] = torch.zeros_like(tensor) if g is None else g.detach()
        return out


def _check_samples(tag: TrainTag | None, tensor: torch.Tensor, caller: str) -> None:
    """A training request counts as many samples as its tensors hold rows, not as many as it claims, and only for
    the trainer that sends it: the name in the tag must be the caller's authenticated peer id."""
    if tag is None:
        return
    if tag.samples != tensor.shape[0]:
        raise BadInputError(f"the request claims {tag.samples} samples but holds {tensor.shape[0]}")
    if tag.trainer != caller:
        raise BadInputError(f"a training request in the name of trainer {tag.trainer} must come from it, not {caller}")


class _Recompute:
    """What a backward needs to recompute a forward the server no longer holds."""

    def __init__(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        pos: torch.Tensor | None,
        sub: Span,
        adapter: Adapter | None,
    ) -> None:
        self.hidden, self.mask, self.pos, self.sub, self.adapter = hidden, mask, pos, sub, adapter
