"""Forward and backward through the remote blocks, as a torch autograd function.

Forward walks the swarm hop by hop (each hop routed from where the last one ended, so a failed peer is routed around
mid-pass) and asks each server to keep its graph for the backward. Backward walks the hops in reverse; if a server
lost the graph it recomputes from the inputs the client kept, and if the server is gone the span is re-routed and
recomputed elsewhere.

With a client adapter, every call names it by version, and carries its tensors for the hop's blocks only when that
server has not seen this version yet; backward replies carry the adapter's gradients, summed into the parameters'."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass

import torch

from swarm.client.adapters import ClientAdapters
from swarm.client.loop import LoopThread
from swarm.client.remote import Remote
from swarm.client.retry import Retrier
from swarm.client.routing import Hop
from swarm.client.swarm_view import SwarmView
from swarm.config import Timing
from swarm.errors import ActivationsGoneError, AdapterMissingError


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
        self.adapters: ClientAdapters | None = None  # set by the model when it tunes remote blocks
        self.train_tag: dict | None = None  # a pre-training trainer's {"step", "samples"}, sent with every call
        self._known: dict[tuple[str, int, int], tuple[int, Hop]] = {}  # (peer, start, end) -> adapter version held

    def __call__(self, hidden: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        params = self.adapters.remote_parameters() if self._remote_adapters() else []
        if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
            return _RemoteFn.apply(hidden, attention_mask, position_ids, self, *params)
        out, _ = self.forward(hidden, attention_mask, position_ids, keep=False)
        return out

    def _remote_adapters(self) -> ClientAdapters | None:
        return self.adapters if self.adapters is not None and self.adapters.applies_remotely else None

    def adapter_needs_sending(self, hop: Hop) -> bool:
        """Whether ``hop``'s server lacks the adapter's current version (as far as this client knows)."""
        adapters = self._remote_adapters()
        return self._known.get((hop.peer_id, hop.start, hop.end), (None,))[0] != adapters.version()

    def adapter_delivered(self, hop: Hop, delivered: bool = True) -> None:
        """Record that ``hop``'s server holds the current version (or, with False, that it lost it)."""
        key = (hop.peer_id, hop.start, hop.end)
        if delivered:
            self._known[key] = (self._remote_adapters().version(), hop)
        else:
            self._known.pop(key, None)

    def _call(self, hop: Hop, meta: dict, tensors: dict) -> dict:
        adapters = self._remote_adapters()
        if adapters is None:
            return self._exchange(hop, meta, tensors)
        send = self.adapter_needs_sending(hop)
        try:
            out = self._exchange(hop, meta, tensors, adapters, send)
        except AdapterMissingError:  # the server dropped its copy (timeout, restart, memory): send it again
            if send:
                raise
            out = self._exchange(hop, meta, tensors, adapters, True)
        self.adapter_delivered(hop)
        return out

    def release_adapters(self, timeout: float = 2.0) -> None:
        """Best effort, at close: ask every server that got this client's adapter to drop it now (each would anyway
        after ``Timing.adapter_ttl``)."""
        adapters = self._remote_adapters()
        if adapters is None:
            return
        hops = list({hop.peer_id: hop for _, hop in self._known.values()}.values())
        meta = {"kind": "release", "start": 0, "end": 1, "adapter": adapters.ref(False).model_dump()}
        if hops:
            with contextlib.suppress(Exception):
                self.loop.run(self.remote.broadcast(hops, meta, timeout), timeout + 1)
        self._known.clear()

    def _exchange(self, hop: Hop, meta: dict, tensors: dict, adapters=None, send=False) -> dict:
        meta = dict(meta, start=hop.start, end=hop.end)
        if adapters is not None:
            meta["adapter"] = adapters.ref(send).model_dump()
            if send:
                payload = adapters.payload(hop.start, hop.end, _wire_dtype(hop))
                self.remote.traffic["adapter_bytes_sent"] += sum(t.nbytes for t in payload.values())
                tensors = dict(tensors, **payload)
        if self.train_tag is not None:
            meta["train"] = self.train_tag
        t0 = time.perf_counter()
        out = self.loop.run(self.remote.compute(hop, meta, tensors, self.timing.request_timeout))
        first = tensors.get("hidden", tensors.get("grad_output"))
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
                plan = self.view.route(position, end, mode="forward", stochastic=self.train_tag is not None)
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

    def backward(
        self, traces: list[Trace], grad: torch.Tensor, attention_mask=None, position_ids=None, input_grad: bool = True
    ) -> tuple[torch.Tensor | None, list[dict]]:
        """The gradient of the first hop's input (None if ``input_grad`` is False), and every hop's reply (which
        holds the adapter's gradients)."""
        aux = self._aux(attention_mask, position_ids)
        replies: list[dict] = []
        for i in reversed(range(len(traces))):
            grad = self._backward_hop(traces[i], grad, aux, attention_mask, position_ids, input_grad or i > 0, replies)
        return grad, replies

    def _backward_hop(self, trace: Trace, grad, aux, attention_mask, position_ids, input_grad, replies):
        hop, dtype = trace.hop, _wire_dtype(trace.hop)
        meta = {"kind": "backward", "forward_id": trace.forward_id, "input_grad": input_grad}
        try:
            try:
                out = self._call(hop, meta, {"grad_output": grad.to(dtype)})
            except ActivationsGoneError:  # the server dropped the graph: same server, recompute from our inputs
                out = self._call(hop, meta, dict(aux, grad_output=grad.to(dtype), hidden=trace.inputs.to(dtype)))
            replies.append(out)
            return out["grad_input"].to(grad.dtype) if input_grad else None
        except Exception as e:
            if not getattr(e, "retriable", False):
                raise
            self.retrier.failovers += 1
            self.view.ban(hop.peer_id, self.timing.ban_base)
        # the server is gone: redo this span's forward elsewhere, keeping graphs, and backpropagate through it
        route = self.last_route
        _, traces = self.forward(trace.inputs, attention_mask, position_ids, keep=True, start=hop.start, end=hop.end)
        if hop in route:  # observers see the whole route, with the replacement in the dead hop's place
            i = route.index(hop)
            self.last_route = route[:i] + [t.hop for t in traces] + route[i + 1 :]
        grad, more = self.backward(traces, grad, attention_mask, position_ids, input_grad)
        replies.extend(more)
        return grad


class _RemoteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, attention_mask, position_ids, blocks: RemoteBlocks, *adapter_params):
        out, traces = blocks.forward(hidden, attention_mask, position_ids, keep=True)
        ctx.blocks, ctx.traces, ctx.aux = blocks, traces, (attention_mask, position_ids)
        ctx.num_params = len(adapter_params)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        blocks = ctx.blocks
        grad, replies = blocks.backward(
            ctx.traces, grad_output.contiguous(), *ctx.aux, input_grad=ctx.needs_input_grad[0]
        )
        params = blocks.adapters.gradients(replies) if ctx.num_params else []
        return grad, None, None, None, *params
