"""Forward and backward requests of fine-tuning and pre-training: validated, the client's adapter bound, run on the
engine's compute thread (``peers.serving.engine``), a forward's graph kept for its backward where the client asks.

A span with trainable weights (a pre-training stage) comes with a ``Learner``: training requests are admitted by it
(brought to the trainer's global step) and the weights' gradients go to it."""

from __future__ import annotations

import torch

from peers.serving.activations import ActivationStore, Kept, SavedBytes, storages
from peers.serving.adapters import Adapter, Pin
from peers.serving.checks import check_aux, check_finite, check_hidden, check_names
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.ports import Tensors
from peers.serving.runtime import SpanRuntime, require
from swarm.config import Timing
from swarm.errors import ActivationsGoneError, BadInputError
from swarm.ids import Span
from swarm.protocol import BackwardRequest, ForwardRequest, ReleaseRequest, TrainTag
from swarm.records import Capability
from swarm.tuning import GRAD_PREFIX


class PassService:
    """Forward and backward passes on the engine; the forwards kept for a backward (``kept``)."""

    def __init__(self, engine: Engine, cfg: ComputeConfig, timing: Timing) -> None:
        self.engine = engine
        self.limits, self.loaded, self.served = engine.limits, engine.loaded, engine.metrics.served
        self.kept = ActivationStore(cfg.max_kept_bytes, cfg.max_caller_kept_bytes, timing.activation_ttl)
        self._weights: tuple[SpanRuntime, set[int]] | None = None  # the runtime's weight storages (see _exclude)

    def release(self, req: ReleaseRequest, caller: str) -> None:
        """The client is done: its cached adapter goes now rather than at the idle timeout."""
        self.engine.adapters.drop(caller, req.client)

    def _exclude(self, adapter: Adapter | None) -> set[int]:
        """Storages a kept graph does not add to memory: the weights (computed once per loaded span) and the
        adapter's cached tensors (counted by the adapter budget)."""
        backend = self.loaded.current()
        if self._weights is None or self._weights[0] is not backend:
            self._weights = backend, storages(backend.weight_tensors())
        named = list(adapter.named().values()) if adapter is not None else []
        return self._weights[1] | storages(named)

    def _admit(self, tag: TrainTag | None) -> None:
        if tag is None:
            return
        learner = self.loaded.learner
        if learner is None:
            raise BadInputError("training request to a peer that holds no trainable stage")
        learner.admit(tag)

    # ---- forward --------------------------------------------------------------------------------------------------
    async def forward(self, req: ForwardRequest, tensors: Tensors, caller: str) -> Tensors:
        sub, backend = self.loaded.serve(req.start, req.end, Capability.FORWARD, "a forward pass")
        if req.keep_for_backward:
            require(backend, Capability.BACKWARD, "a forward kept for a backward (keep_for_backward)")
        check_names(tensors)
        hidden = check_hidden(tensors, self.limits)
        check_finite(hidden, "hidden")
        mask, pos = check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1], self.limits)
        if req.keep_for_backward and not req.forward_id:
            raise BadInputError("keep_for_backward needs a forward_id")
        _check_samples(req.train, hidden, caller)
        adapter, pin = self.engine.adapters.bind(caller, req.adapter, tensors, sub)
        kept: Kept | None = None
        try:
            if not req.keep_for_backward:
                out = await self.engine.run(self._forward, hidden, sub, mask, pos, adapter, req.train, caller=caller)
                self.served["forward"] += 1
                return {"hidden": out}
            kept = await self.engine.run(self._forward_kept, hidden, sub, mask, pos, adapter, req.train, caller=caller)
        finally:
            if pin is not None and kept is None:  # the request is done with the adapter (else the kept graph is)
                pin.release()
        # stored on the RPC loop, not the compute thread, so the stores (and the pins they release) change on one thread
        kept.pin = pin
        assert req.forward_id is not None
        if not self.kept.put(caller, req.forward_id, kept):
            self.served["not_kept"] += 1  # over the caps: the backward gets ActivationsGoneError, the client recomputes
        self.served["forward"] += 1
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
        backend = self.loaded.current()
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
        backend = self.loaded.current()
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
        sub, _ = self.loaded.serve(req.start, req.end, Capability.BACKWARD, "a backward pass")
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
            adapter, pin = self.engine.adapters.bind(caller, req.adapter, tensors, sub)
            kept = _Recompute(hidden, mask, pos, sub, adapter)
        try:
            out = await self.engine.run(self._backward, kept, grad, req.input_grad, req.train, caller=caller)
        finally:
            if isinstance(kept, _Recompute) and pin is not None:
                pin.release()
        self.served["backward"] += 1
        learner = self.loaded.learner
        if learner is not None and learner.pending:  # its averaging round and checkpoint run after this reply
            self.engine.in_background(learner.finish_step)
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
        backend = self.loaded.current()
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
            learner = self.loaded.learner if tag is not None else None
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
