"""One compute path shared by forward, backward and inference: validate, then run on the single compute thread."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from peers.activations import ActivationStore
from peers.adapters import Adapter, AdapterCache, parse_adapter
from peers.blocks.backend import SpanBackend
from peers.kv_cache import CacheBudget
from swarm.config import PeerConfig
from swarm.errors import (
    ActivationsGoneError,
    BadInputError,
    PeerUnavailableError,
    SessionLengthError,
    StaleStepError,
)
from swarm.ids import Span
from swarm.protocol import AdapterRef, ComputeRequest, OpenSession
from swarm.tuning import GRAD_PREFIX, is_adapter_name

log = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    sub: Span
    max_length: int
    batch: int
    cache: object
    reserved: int
    position: int = 0
    adapter: Adapter | None = None  # the client's adapter, bound for the session's life


class ComputeService:
    def __init__(
        self, backend: SpanBackend | None, cfg: PeerConfig, hidden_size: int, dtype: torch.dtype, num_blocks: int
    ) -> None:
        self.backend = backend
        self.num_blocks = num_blocks
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.serving = backend is not None  # a standby holds weights but takes no requests
        # One thread: a device runs one kernel stream anyway, and torch releases the GIL so the RPC loop stays live.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.budget = CacheBudget(cfg.cache_tokens)
        self.kept = ActivationStore(cfg.max_kept_activations, cfg.timing.activation_ttl)
        self.adapters = AdapterCache(cfg.max_adapter_bytes, cfg.timing.adapter_ttl)
        self.stats: Counter[str] = Counter()
        self.sessions: dict[str, Session] = {}
        self.leaving = False  # set on shutdown: open sessions finish, new ones go elsewhere
        self.trainer = None  # peers.training.SpanTrainer on a pre-training run's peer
        self._tasks: set[asyncio.Task] = set()

    def set_backend(self, backend: SpanBackend) -> None:
        """Swap in a newly loaded span. Sessions on blocks the new span lacks end at their next step."""
        self.backend = backend

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args, small: bool = False):
        if small:  # a few tokens: computing inline beats two thread hand-offs (the loop waits ~ms anyway)
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- validation -------------------------------------------------------------------------------------------
    def _check_sub(self, start: int, end: int) -> Span:
        if self.backend is None or not self.serving:
            raise PeerUnavailableError("this peer serves no blocks right now (joining or standby)")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
            raise BadInputError(f"invalid block span {start}:{end}")
        if end > self.num_blocks:
            raise BadInputError(f"unknown blocks {start}:{end}: the model has {self.num_blocks} blocks")
        sub = Span(start, end)
        if sub not in self.backend.span:  # a stale view of the swarm, most likely: retriable elsewhere
            raise PeerUnavailableError(f"this server holds blocks {self.backend.span}, not {sub}")
        return sub

    def _check_hidden(self, tensors: dict, name: str = "hidden") -> torch.Tensor:
        hidden = tensors.get(name)
        if hidden is None:
            raise BadInputError(f"request has no {name!r} tensor")
        if hidden.ndim != 3 or hidden.shape[-1] != self.hidden_size:
            raise BadInputError(f"{name} must be [batch, seq, {self.hidden_size}], got {list(hidden.shape)}")
        if hidden.dtype != self.dtype:
            raise BadInputError(f"{name} must be {self.dtype}, got {hidden.dtype}")
        if hidden.shape[0] * hidden.shape[1] > self.cfg.max_batch_tokens:
            raise BadInputError(f"batch x seq {hidden.shape[0] * hidden.shape[1]} exceeds {self.cfg.max_batch_tokens}")
        if hidden.shape[1] == 0:
            raise BadInputError(f"{name} has no tokens")
        return hidden

    @staticmethod
    def _check_aux(tensors: dict, batch: int, n: int, total: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        mask, pos = tensors.get("attention_mask"), tensors.get("position_ids")
        if mask is not None and (mask.dtype != torch.int64 or tuple(mask.shape) != (batch, total)):
            raise BadInputError(f"attention_mask must be int64 [{batch}, {total}], got {mask.dtype} {list(mask.shape)}")
        if pos is not None and (pos.dtype != torch.int64 or tuple(pos.shape) != (batch, n)):
            raise BadInputError(f"position_ids must be int64 [{batch}, {n}], got {pos.dtype} {list(pos.shape)}")
        return mask, pos

    def _adapter(self, ref: AdapterRef | None, tensors: dict, sub: Span) -> Adapter | None:
        """The request's adapter: the tensors it carries (then cached for this client), or the cached version."""
        if ref is None:
            if any(is_adapter_name(name) for name in tensors):
                raise BadInputError("request carries adapter tensors but no adapter reference")
            return None
        if not ref.has_tensors:
            return self.adapters.get(ref, sub)
        adapter = parse_adapter(tensors, sub, self.backend.linears, self.hidden_size, self.dtype, ref.scaling)
        self.adapters.put(ref, adapter, sub)
        self.stats["adapter_uploads"] += 1
        return adapter

    async def in_compute(self, fn, *args):
        """Run ``fn`` on the compute thread, between requests (optimizer steps that the swarm's progress calls for)."""
        return await self._run(fn, *args)

    async def state(self, req: ComputeRequest, tensors: dict) -> dict:
        """A trainable stage's weights and optimizer state, for a joining replica or an export."""
        if self.trainer is None:
            raise BadInputError("this peer holds no trainable stage")
        meta, out = await self._run(self.trainer.export_state)
        return {name: t.clone() for name, t in out.items()} | {"_step": torch.tensor(meta["step"])}

    async def advance(self, req: ComputeRequest, tensors: dict) -> dict:
        """A trainer finished a global step: take ours now (a replica that saw none of the step's micro-batches would
        otherwise wait for its next request), without making the trainer wait for it or for an averaging round."""
        if self.trainer is None or req.train is None:
            raise BadInputError("step notice to a peer that holds no trainable stage, or without a step")
        if req.train.step > self.trainer.step:
            self._background(self.trainer.catch_up, req.train.step)
        return {}

    def _background(self, fn, *args) -> None:
        """Queue ``fn`` on the compute thread without anyone waiting for it; its failure is logged."""

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.warning("background %s failed: %s", fn.__name__, task.exception())

        task = asyncio.ensure_future(self.in_compute(fn, *args))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(done)

    def _train(self, req: ComputeRequest, backward: bool):
        """The trainer of a training request, with the stage brought to the request's step."""
        if req.train is None:
            return None
        if self.trainer is None:
            raise BadInputError("training request to a peer that holds no trainable stage")
        if backward and req.train.step < self.trainer.step:  # the step moved on since this micro-batch's forward
            raise StaleStepError(f"backward for step {req.train.step}: server step {self.trainer.step}")
        self.trainer.before_request(req.train.step)
        return self.trainer

    async def release(self, req: ComputeRequest, tensors: dict) -> dict:
        """The client is done: drop its cached adapter now rather than at the idle timeout."""
        if req.adapter is None:
            raise BadInputError("release names no adapter")
        self.adapters.drop(req.adapter.client)
        return {}

    # ---- forward / backward -----------------------------------------------------------------------------------
    async def forward(self, req: ComputeRequest, tensors: dict) -> dict:
        sub = self._check_sub(req.start, req.end)
        hidden = self._check_hidden(tensors)
        mask, pos = self._check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1])
        if req.keep_for_backward and not req.forward_id:
            raise BadInputError("keep_for_backward needs a forward_id")
        adapter = self._adapter(req.adapter, tensors, sub)
        keep_id = req.forward_id if req.keep_for_backward else None
        out = await self._run(self._forward_sync, hidden, sub, mask, pos, keep_id, adapter, req)
        self.stats["forward"] += 1
        return {"hidden": out}

    def _forward_sync(self, hidden, sub, mask, pos, keep_id, adapter, req=None):
        if req is not None:
            self._train(req, backward=False)
        if keep_id is None:
            with torch.inference_mode():
                return self.backend.run(hidden, sub, attention_mask=mask, position_ids=pos, adapter=adapter)
        with torch.enable_grad():
            inputs = hidden.detach().requires_grad_(True)
            adapter = adapter.trainable() if adapter is not None else None
            outputs = self.backend.run(inputs, sub, attention_mask=mask, position_ids=pos, adapter=adapter)
        self.kept.put(keep_id, inputs, outputs, sub, adapter)
        return outputs.detach()

    async def backward(self, req: ComputeRequest, tensors: dict) -> dict:
        sub = self._check_sub(req.start, req.end)
        grad = self._check_hidden(tensors, "grad_output")
        kept = self.kept.pop(req.forward_id) if req.forward_id else None
        if kept is not None and (kept.sub != sub or kept.outputs.shape != grad.shape):
            raise BadInputError("grad_output does not match the kept forward pass")
        hidden = mask = pos = None
        if kept is None:  # recompute the forward from the inputs the client resent
            if "hidden" not in tensors:
                raise ActivationsGoneError("the forward pass for this backward is gone; resend its inputs")
            hidden = self._check_hidden(tensors)
            if hidden.shape != grad.shape:
                raise BadInputError("grad_output and hidden differ in shape")
            mask, pos = self._check_aux(tensors, hidden.shape[0], hidden.shape[1], hidden.shape[1])
        adapter = self._adapter(req.adapter, tensors, sub) if kept is None else None
        out = await self._run(self._backward_sync, kept, hidden, mask, pos, grad, sub, adapter, req.input_grad, req)
        self.stats["backward"] += 1
        if self.trainer is not None and self.trainer.unfinished:  # averaging/checkpoint after this reply goes out
            self._background(self.trainer.finish_step)
        return out

    def _backward_sync(self, kept, hidden, mask, pos, grad, sub, adapter, input_grad: bool, req=None) -> dict:
        trainer = self._train(req, backward=True) if req is not None else None
        try:
            return self._backward_grads(kept, hidden, mask, pos, grad, sub, adapter, input_grad, trainer, req)
        except RuntimeError as e:
            if kept is not None and "modified by an inplace operation" in str(e):
                # an optimizer step changed the weights after this forward: the client recomputes it
                raise ActivationsGoneError("the weights changed since this forward pass; resend its inputs") from None
            raise

    def _backward_grads(self, kept, hidden, mask, pos, grad, sub, adapter, input_grad, trainer, req) -> dict:
        with torch.enable_grad():
            if kept is None:
                inputs = hidden.detach().requires_grad_(True)
                adapter = adapter.trainable() if adapter is not None else None
                outputs = self.backend.run(inputs, sub, attention_mask=mask, position_ids=pos, adapter=adapter)
            else:
                inputs, outputs, adapter = kept.inputs, kept.outputs, kept.adapter
            named = adapter.named() if adapter is not None else {}
            weights = self.trainer.params if trainer is not None else []
            wrt = ([inputs] if input_grad else []) + list(named.values()) + weights
            if not wrt:
                raise BadInputError("backward asks for no gradient: no input gradient and no adapter")
            grads = list(torch.autograd.grad(outputs, wrt, grad.to(outputs.device), allow_unused=True))
        if weights:  # a trainable stage: accumulate its weights' gradients toward the global batch
            for p, g in zip(weights, grads[len(grads) - len(weights) :], strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
            del grads[len(grads) - len(weights) :]
            trainer.after_backward(req.train.samples)
        out = {"grad_input": grads.pop(0).detach()} if input_grad else {}
        for (name, tensor), g in zip(named.items(), grads, strict=True):
            out[GRAD_PREFIX + name] = torch.zeros_like(tensor) if g is None else g.detach()
        return out

    # ---- inference ----------------------------------------------------------------------------------------------
    async def open_session(self, msg: OpenSession, tensors: dict) -> Session:
        if self.leaving:
            raise PeerUnavailableError("this server is leaving the swarm; open the session elsewhere")
        sub = self._check_sub(msg.start, msg.end)
        if msg.session_id in self.sessions:
            raise BadInputError(f"session {msg.session_id} is already open here")
        adapter = self._adapter(msg.adapter, tensors, sub)
        tokens = msg.batch_size * msg.max_length
        reserved = await self.budget.reserve(tokens, self.cfg.timing.cache_wait)
        cache = self.backend.new_cache()
        session = Session(msg.session_id, sub, msg.max_length, msg.batch_size, cache, reserved, adapter=adapter)
        self.sessions[session.id] = session
        self.stats["sessions"] += 1
        return session

    async def close_session(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            session.cache = None
            await self.budget.release(session.reserved)

    async def step(self, session: Session, position: int, tensors: dict) -> dict:
        hidden = self._check_hidden(tensors)
        batch, n = hidden.shape[:2]
        if batch != session.batch:
            raise BadInputError(f"session was opened for batch {session.batch}, step has batch {batch}")
        if position != session.position:
            raise BadInputError(f"step at position {position}, but this server holds {session.position} tokens")
        if session.sub not in self.backend.span:
            raise PeerUnavailableError(f"this peer moved to blocks {self.backend.span}; reopen the session elsewhere")
        if position + n > session.max_length:
            raise SessionLengthError(
                f"session of max_length {session.max_length} cannot take {n} more tokens at position {position}"
            )
        mask, pos = self._check_aux(tensors, batch, n, position + n)
        out = await self._run(self._step_sync, session, hidden, mask, pos, small=batch * n <= self.cfg.inline_tokens)
        session.position += n
        self.stats["inference_steps"] += 1
        return {"hidden": out}

    def _step_sync(self, session, hidden, mask, pos):
        with torch.inference_mode():
            return self.backend.run(
                hidden,
                session.sub,
                attention_mask=mask,
                position_ids=pos,
                cache=session.cache,
                past=session.position,
                adapter=session.adapter,
            )
