"""Forward and backward through the remote blocks, as a torch autograd function.

Forward walks the swarm hop by hop along the route planned when the pass began (re-planned from where the last hop
ended when a hop fails, so a failed peer is routed around mid-pass) and asks each server to keep its graph for the
backward. Backward walks the hops in reverse; if a server
lost the graph it recomputes from the inputs the client kept, and if the server is gone the retry helper bans it and
the span is re-routed, its forward recomputed elsewhere and backpropagated there.

With a client adapter, every call names it by version, and carries its tensors for the hop's blocks only when that
server has not seen this version yet; backward replies carry the adapter's gradients, summed into the parameters'.
A pre-training trainer's ``TrainTag`` goes with every call of its micro-batch, whose routes are drawn stochastically
(replicas in proportion to their speed)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from swarm.client.adapters import AdapterDelivery
from swarm.client.connection import SwarmConnection
from swarm.client.replies import checked, expected
from swarm.errors import ActivationsGoneError, AdapterMissingError
from swarm.protocol import BackwardRequest, ForwardRequest, TrainTag
from swarm.rpc.hop import Hop
from swarm.rpc.remote import Tensors


@dataclass
class Trace:
    hop: Hop
    forward_id: str | None
    inputs: torch.Tensor  # what the hop received, in the client's dtype


def _wire_dtype(hop: Hop) -> torch.dtype:
    dtype = getattr(torch, hop.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _aux(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> Tensors:
    aux: Tensors = {}
    if attention_mask is not None:
        aux["attention_mask"] = attention_mask.to(torch.int64)
    if position_ids is not None:
        aux["position_ids"] = position_ids.to(torch.int64)
    return aux


class RemoteBlocks:
    def __init__(self, conn: SwarmConnection, delivery: AdapterDelivery | None = None) -> None:
        self.conn = conn
        self.delivery = delivery  # set when the model tunes remote blocks (LoRA, deep prompts)
        self.last_route: list[Hop] = []

    def __call__(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        train: TrainTag | None = None,
    ) -> torch.Tensor:
        params = self.delivery.adapters.remote_parameters() if self.delivery is not None else []
        if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
            # torch declares Function.apply without types
            out: torch.Tensor = _RemoteFn.apply(  # type: ignore[no-untyped-call]
                hidden, attention_mask, position_ids, self, train, *params
            )
            return out
        return self.forward(hidden, attention_mask, position_ids, keep=False, train=train)[0]

    # ---- one call ---------------------------------------------------------------------------------------------------
    def _call(self, hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors) -> Tensors:
        """One compute call, with the adapter part the server needs (resent once if it dropped its copy)."""
        delivery = self.delivery
        if delivery is None:
            return self._exchange(hop, request, tensors)
        send = delivery.needs_sending(hop)
        try:
            out = self._exchange(hop, request, tensors, send)
        except AdapterMissingError:  # the server dropped its copy (timeout, restart, memory): send it again
            if send:
                raise
            out = self._exchange(hop, request, tensors, True)
        delivery.delivered(hop)
        return out

    def _exchange(self, hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors,
                  send: bool = False) -> Tensors:  # fmt: skip
        adapter: Tensors = {}  # the adapter tensors the server applies, sent or not: a backward returns their grads
        if self.delivery is not None:
            ref, payload = self.delivery.part(hop, send)
            request = request.model_copy(update={"adapter": ref})
            self.conn.remote.traffic["adapter_bytes_sent"] += sum(t.nbytes for t in payload.values())
            adapter = payload or self.delivery.adapters.payload(hop.start, hop.end, _wire_dtype(hop))
            tensors = dict(tensors, **payload)
        conn = self.conn
        expect = expected(request, tensors, adapter)
        t0 = time.perf_counter()
        call = conn.remote.compute(hop, request, tensors, conn.timing.request_timeout, expect.max_bytes)
        out = conn.loop.run(checked(hop.peer_id, expect, call))
        first = tensors.get("hidden", tensors.get("grad_output"))
        assert first is not None
        passes = 1 if isinstance(request, ForwardRequest) else 2  # a backward costs about two forwards
        units = passes * first.shape[0] * first.shape[1] * len(hop.span)
        conn.view.observe(hop.peer_id, "forward", time.perf_counter() - t0, units)
        return out

    # ---- forward ----------------------------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        keep: bool,
        train: TrainTag | None = None,
        start: int = 0,
        end: int | None = None,
    ) -> tuple[torch.Tensor, list[Trace]]:
        conn = self.conn
        end = conn.view.num_blocks if end is None else end
        aux = _aux(attention_mask, position_ids)
        traces: list[Trace] = []
        position, h = start, hidden.detach()
        plan: list[Hop] = []  # the route planned when the pass began (or when a hop of it last failed)
        while position < end:

            def attempt(position: int = position, h: torch.Tensor = h) -> tuple[Hop, str | None, torch.Tensor]:
                nonlocal plan
                if not plan or plan[0].start != position:
                    plan = conn.view.route(position, end, mode="forward", stochastic=train is not None)
                self.last_route = [t.hop for t in traces] + plan  # the route as currently planned, for observers
                hop = plan[0]
                forward_id = uuid.uuid4().hex if keep else None
                request = ForwardRequest(start=hop.start, end=hop.end, keep_for_backward=keep, forward_id=forward_id,
                                         train=train)  # fmt: skip
                try:
                    out = self._call(hop, request, dict(aux, hidden=h.to(_wire_dtype(hop))))["hidden"]
                except BaseException:
                    plan = []  # the retry routes the rest afresh, around the failed peer
                    raise
                return hop, forward_id, out

            hop, forward_id, out = conn.retrier.run(attempt, "forward", confirm=True)
            traces.append(Trace(hop, forward_id, h))
            position, h, plan = hop.end, out.to(hidden.dtype), plan[1:]
        self.last_route = [t.hop for t in traces]
        return h, traces

    # ---- backward ---------------------------------------------------------------------------------------------------
    def backward(
        self,
        traces: list[Trace],
        grad: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        input_grad: bool = True,
        train: TrainTag | None = None,
    ) -> tuple[torch.Tensor | None, list[Tensors]]:
        """The gradient of the first hop's input (None if ``input_grad`` is False), and every hop's reply (which
        holds the adapter's gradients)."""
        replies: list[Tensors] = []
        g: torch.Tensor | None = grad
        for i in reversed(range(len(traces))):
            assert g is not None
            g = self._backward_span(traces[i], g, attention_mask, position_ids, input_grad or i > 0, train, replies)
        return g, replies

    def _backward_span(self, trace: Trace, grad: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, input_grad: bool, train: TrainTag | None,
                       replies: list[Tensors]) -> torch.Tensor | None:  # fmt: skip
        """Backpropagate through one traced hop. If its server fails, the retry helper bans it and the next
        attempt recomputes this span's forward elsewhere (keeping graphs) and backpropagates through that."""
        first = [True]
        route = self.last_route

        def attempt() -> tuple[torch.Tensor | None, list[Tensors]]:
            if first[0]:
                first[0] = False
                return self._backward_hop(trace, grad, attention_mask, position_ids, input_grad, train)
            hop = trace.hop
            _, traces = self.forward(trace.inputs, attention_mask, position_ids, keep=True, train=train,
                                     start=hop.start, end=hop.end)  # fmt: skip
            if hop in route:  # observers see the whole route, with the replacement in the dead hop's place
                i = route.index(hop)
                self.last_route = route[:i] + [t.hop for t in traces] + route[i + 1 :]
            return self.backward(traces, grad, attention_mask, position_ids, input_grad, train)

        g, more = self.conn.retrier.run(attempt, "backward", confirm=True)
        replies.extend(more)
        return g

    def _backward_hop(self, trace: Trace, grad: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, input_grad: bool,
                      train: TrainTag | None) -> tuple[torch.Tensor | None, list[Tensors]]:  # fmt: skip
        hop, dtype = trace.hop, _wire_dtype(trace.hop)
        request = BackwardRequest(start=hop.start, end=hop.end, forward_id=trace.forward_id, input_grad=input_grad,
                                  train=train)  # fmt: skip
        try:
            out = self._call(hop, request, {"grad_output": grad.to(dtype)})
        except ActivationsGoneError:  # the server dropped the graph: same server, recompute from our inputs
            resend = dict(_aux(attention_mask, position_ids), hidden=trace.inputs.to(dtype))
            out = self._call(hop, request, dict(resend, grad_output=grad.to(dtype)))
        return (out["grad_input"].to(grad.dtype) if input_grad else None), [out]


class _RemoteFn(torch.autograd.Function):
    # ``ctx: Any``: torch's autograd context takes arbitrary attributes and declares none
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, blocks: RemoteBlocks, train: TrainTag | None,
                *adapter_params: torch.Tensor) -> torch.Tensor:  # fmt: skip
        out, traces = blocks.forward(hidden, attention_mask, position_ids, keep=True, train=train)
        ctx.blocks, ctx.traces, ctx.aux, ctx.train = blocks, traces, (attention_mask, position_ids), train
        ctx.num_params = len(adapter_params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        blocks: RemoteBlocks = ctx.blocks
        mask, positions = ctx.aux
        grad, replies = blocks.backward(ctx.traces, grad_output.contiguous(), mask, positions,
                                        input_grad=ctx.needs_input_grad[0], train=ctx.train)  # fmt: skip
        delivery = blocks.delivery
        params = delivery.adapters.gradients(replies) if ctx.num_params and delivery is not None else []
        return (grad, None, None, None, None, *params)
