"""Forward and backward through the remote blocks, as a torch autograd function.

Forward walks the swarm hop by hop (each hop routed from where the last one ended, so a failed peer is routed around
mid-pass) and asks each server to keep its graph for the backward. Backward walks the hops in reverse; if a server
lost the graph it recomputes from the inputs the client kept, and if the server is gone the span is re-routed and
recomputed elsewhere."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch

from swarm.client.loop import LoopThread
from swarm.client.remote import Remote
from swarm.client.retry import Retrier
from swarm.client.routing import Hop
from swarm.client.swarm_view import SwarmView
from swarm.config import Timing
from swarm.errors import ActivationsGoneError


@dataclass
class Trace:
    hop: Hop
    forward_id: str | None
    inputs: torch.Tensor  # what the hop received, in the client's dtype


def _wire_dtype(hop: Hop) -> torch.dtype:
    return getattr(torch, hop.dtype)


class RemoteBlocks:
    def __init__(self, view: SwarmView, remote: Remote, loop: LoopThread, retrier: Retrier, timing: Timing) -> None:
        self.view = view
        self.remote = remote
        self.loop = loop
        self.retrier = retrier
        self.timing = timing
        self.last_route: list[Hop] = []

    def __call__(self, hidden: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        if torch.is_grad_enabled() and hidden.requires_grad:
            return _RemoteFn.apply(hidden, attention_mask, position_ids, self)
        out, _ = self.forward(hidden, attention_mask, position_ids, keep=False)
        return out

    def _call(self, hop: Hop, meta: dict, tensors: dict) -> dict:
        meta = dict(meta, start=hop.start, end=hop.end)
        t0 = time.perf_counter()
        out = self.loop.run(self.remote.compute(hop, meta, tensors, self.timing.request_timeout))
        first = next(iter(tensors.values()))
        tokens = first.shape[0] * first.shape[1]
        passes = 1 if meta["kind"] == "forward" else 2  # a backward costs about two forwards
        self.view.observe(hop.peer_id, time.perf_counter() - t0, passes * tokens * hop.token_seconds)
        return out

    @staticmethod
    def _aux(attention_mask, position_ids) -> dict:
        aux = {}
        if attention_mask is not None:
            aux["attention_mask"] = attention_mask.to(torch.int64)
        if position_ids is not None:
            aux["position_ids"] = position_ids.to(torch.int64)
        return aux

    def forward(
        self, hidden, attention_mask=None, position_ids=None, *, keep: bool, start: int = 0, end: int | None = None
    ) -> tuple[torch.Tensor, list[Trace]]:
        end = self.view.num_blocks if end is None else end
        aux = self._aux(attention_mask, position_ids)
        traces: list[Trace] = []
        position, h = start, hidden.detach()
        while position < end:

            def attempt(position=position, h=h):
                plan = self.view.route(position, end, mode="forward")
                self.last_route = [t.hop for t in traces] + plan  # the route as currently planned, for observers
                hop = plan[0]
                forward_id = uuid.uuid4().hex if keep else None
                meta = {"kind": "forward", "keep_for_backward": keep, "forward_id": forward_id}
                out = self._call(hop, meta, dict(aux, hidden=h.to(_wire_dtype(hop))))["hidden"]
                return hop, forward_id, out

            hop, forward_id, out = self.retrier.run(attempt, "forward")
            traces.append(Trace(hop, forward_id, h))
            position, h = hop.end, out.to(hidden.dtype)
        self.last_route = [t.hop for t in traces]
        return h, traces

    def backward(self, traces: list[Trace], grad: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        aux = self._aux(attention_mask, position_ids)
        for trace in reversed(traces):
            grad = self._backward_hop(trace, grad, aux, attention_mask, position_ids)
        return grad

    def _backward_hop(self, trace: Trace, grad, aux, attention_mask, position_ids) -> torch.Tensor:
        hop, dtype = trace.hop, _wire_dtype(trace.hop)
        meta = {"kind": "backward", "forward_id": trace.forward_id}
        try:
            try:
                out = self._call(hop, meta, {"grad_output": grad.to(dtype)})
            except ActivationsGoneError:  # the server dropped the graph: same server, recompute from our inputs
                out = self._call(hop, meta, dict(aux, grad_output=grad.to(dtype), hidden=trace.inputs.to(dtype)))
            return out["grad_input"].to(grad.dtype)
        except Exception as e:
            if not getattr(e, "retriable", False):
                raise
            self.retrier.failovers += 1
            self.view.ban(hop.peer_id, self.timing.ban_base)
        # the server is gone: redo this span's forward elsewhere, keeping graphs, and backpropagate through it
        _, traces = self.forward(trace.inputs, attention_mask, position_ids, keep=True, start=hop.start, end=hop.end)
        return self.backward(traces, grad, attention_mask, position_ids)


class _RemoteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, attention_mask, position_ids, blocks: RemoteBlocks):
        out, traces = blocks.forward(hidden, attention_mask, position_ids, keep=True)
        ctx.blocks, ctx.traces, ctx.aux = blocks, traces, (attention_mask, position_ids)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.blocks.backward(ctx.traces, grad_output.contiguous(), *ctx.aux)
        return grad, None, None, None
