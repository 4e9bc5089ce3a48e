"""Forward and backward requests: validate, bind the client's adapter, run on the single compute thread.

The compute thread is one thread: a device runs one kernel stream anyway, and torch releases the GIL so the RPC
loop stays live. A span with trainable weights (a pre-training stage) comes with a ``Learner``: training requests
are admitted by it (brought to the trainer's global step) and the weights' gradients go to it."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

from peers.activations import ActivationStore, Kept
from peers.adapters import Adapter, AdapterCache, parse_adapter
from peers.blocks.backend import SpanBackend
from peers.config import ComputeConfig
from peers.rpc.checks import Limits, check_aux, check_hidden, check_sub
from swarm.config import Timing
from swarm.errors import ActivationsGoneError, BadInputError
from swarm.ids import Span
from swarm.protocol import AdapterRef, BackwardRequest, ForwardRequest, ReleaseRequest, TrainTag
from swarm.tuning import GRAD_PREFIX, is_adapter_name

log = logging.getLogger(__name__)
T = TypeVar("T")
Tensors = dict[str, torch.Tensor]


class Learner(Protocol):
    """A span whose weights learn (``peers.training.span_trainer.SpanTrainer``)."""

    params: list[torch.nn.Parameter]

    def admit(self, tag: TrainTag) -> None:
        """Bring the span to the request's global step, or refuse a request of a step already done."""

    def accumulate(self, grads: Sequence[torch.Tensor | None], samples: int, trainer: str) -> None:
        """Add a micro-batch's weight gradients toward the global batch (and step when it is complete); refuse a
        non-finite one, bound a huge one, count the samples per trainer."""

    @property
    def pending(self) -> bool:
        """A step was applied whose averaging round and checkpoint are still to do."""

    def finish_step(self) -> None: ...


class ComputeService:
    def __init__(self, limits: Limits, cfg: ComputeConfig, timing: Timing) -> None:
        self.limits = limits
        self.backend: SpanBackend | None = None
        self.learner: Learner | None = None
        self.serving = False  # a standby holds weights but takes no requests
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.kept = ActivationStore(cfg.max_kept_activations, timing.activation_ttl)
        self.adapters = AdapterCache(cfg.max_adapter_bytes, timing.adapter_ttl)
        self.stats: Counter[str] = Counter()
        self.active = 0  # requests the servicer is processing now (reported by info)
        self._tasks: set[asyncio.Task[object]] = set()

    def set_backend(self, backend: SpanBackend, learner: Learner | None = None) -> None:
        """Swap in a newly loaded span. Sessions on blocks the new span lacks end at their next step."""
        self.backend, self.learner = backend, learner

    @property
    def held(self) -> Span | None:
        """The blocks this peer serves requests for now (None while joining or standby)."""
        return self.backend.span if self.backend is not None and self.serving else None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: object, small: bool = False) -> T:
        """``fn`` on the compute thread; a small request (a few tokens) inline, where two thread hand-offs would
        cost more than the compute."""
        if small:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

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

    def bind_adapter(self, ref: AdapterRef | None, tensors: Tensors, sub: Span) -> Adapter | None:
        """The request's adapter: the tensors it carries (then cached for this client), or the cached version."""
        if ref is None:
            if any(is_adapter_name(name) for name in tensors):
                raise BadInputError("request carries adapter tensors but no adapter reference")
            return None
        if not ref.has_tensors:
            return self.adapters.get(ref, sub)
        assert self.backend is not None
        limits = self.limits
        adapter = parse_adapter(tensors, sub, self.backend.linears, limits.hidden_size, limits.dtype, ref.scaling)
        self.adapters.put(ref, adapter, sub)
        self.stats["adapter_uploads"] += 1
        return adapter

    def release(self, req: ReleaseRequest) -> None:
        """The client is done: drop its cached adapter now rather than at the idle timeout."""
        self.adapters.drop(req.client)

    def _admit(self, tag: TrainTag | None) -> None:
        if tag is None:
            return
        if self.learner is None:
            raise BadInputError("training request to a peer that holds no trainable stage")
        self.learner.admit(tag)

    # ---- forward --------------------------------------------------------------------------------------------------
    async def forward(self, req: ForwardRequest, tensors: Tensors) -> Tensors:
        sub = self.sub(req.start, req.end)
        hidden = check_hidden(tensors, self.limits)
        mask, pos = check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1])
        if req.keep_for_backward and not req.forward_id:
            raise BadInputError("keep_for_backward needs a forward_id")
        _check_samples(req.train, hidden)
        adapter = self.bind_adapter(req.adapter, tensors, sub)
        keep = req.forward_id if req.keep_for_backward else None
        out = await self.run(self._forward, hidden, sub, mask, pos, keep, adapter, req.train)
        self.stats["forward"] += 1
        return {"hidden": out}

    def _forward(self, hidden: torch.Tensor, sub: Span, mask: torch.Tensor | None, pos: torch.Tensor | None,
                 keep: str | None, adapter: Adapter | None, tag: TrainTag | None) -> torch.Tensor:  # fmt: skip
        self._admit(tag)
        backend = self.backend
        assert backend is not None
        if keep is None:
            with torch.inference_mode():
                return backend.run(hidden, sub, attention_mask=mask, position_ids=pos, adapter=adapter)
        with torch.enable_grad():
            inputs = hidden.detach().requires_grad_(True)
            adapter = adapter.trainable() if adapter is not None else None
            outputs = backend.run(inputs, sub, attention_mask=mask, position_ids=pos, adapter=adapter)
        self.kept.put(keep, inputs, outputs, sub, adapter)
        return outputs.detach()

    # ---- backward -------------------------------------------------------------------------------------------------
    async def backward(self, req: BackwardRequest, tensors: Tensors) -> Tensors:
        sub = self.sub(req.start, req.end)
        grad = check_hidden(tensors, self.limits, "grad_output")
        _check_samples(req.train, grad)
        if req.train is not None and not bool(torch.isfinite(grad).all()):
            raise BadInputError("grad_output holds NaN or infinite values")
        held = self.kept.pop(req.forward_id) if req.forward_id else None
        if held is not None and (held.sub != sub or held.outputs.shape != grad.shape):
            raise BadInputError("grad_output does not match the kept forward pass")
        kept: Kept | _Recompute
        if held is not None:
            kept = held
        else:  # recompute the forward from the inputs the client resent
            if "hidden" not in tensors:
                raise ActivationsGoneError("the forward pass for this backward is gone; resend its inputs")
            hidden = check_hidden(tensors, self.limits)
            if hidden.shape != grad.shape:
                raise BadInputError("grad_output and hidden differ in shape")
            mask, pos = check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1])
            adapter = self.bind_adapter(req.adapter, tensors, sub)
            kept = _Recompute(hidden, mask, pos, sub, adapter)
        out = await self.run(self._backward, kept, grad, req.input_grad, req.train)
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
                outputs = backend.run(inputs, kept.sub, attention_mask=kept.mask, position_ids=kept.pos,
                                      adapter=adapter)  # fmt: skip
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
            learner.accumulate(grads[len(grads) - len(weights) :], tag.samples, tag.trainer)
            del grads[len(grads) - len(weights) :]
        out: Tensors = {}
        if input_grad:
            first = grads.pop(0)
            assert first is not None
            out["grad_input"] = first.detach()
        for (name, tensor), g in zip(named.items(), grads, strict=True):
            out[GRAD_PREFIX + name] = torch.zeros_like(tensor) if g is None else g.detach()
        return out


def _check_samples(tag: TrainTag | None, tensor: torch.Tensor) -> None:
    """A training request counts as many samples as its tensors hold rows, not as many as it claims."""
    if tag is not None and tag.samples != tensor.shape[0]:
        raise BadInputError(f"the request claims {tag.samples} samples but holds {tensor.shape[0]}")


class _Recompute:
    """What a backward needs to recompute a forward the server no longer holds."""

    def __init__(self, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None, sub: Span,
                 adapter: Adapter | None) -> None:  # fmt: skip
        self.hidden, self.mask, self.pos, self.sub, self.adapter = hidden, mask, pos, sub, adapter
