"""The remote part of a forward or training plan: its ``span_forward`` and ``span_backward`` nodes, run server by
server, with failover as plan repair.

Forward runs the plan's forward nodes in chain order, each through its transfers (the casts to and from the
server's wire dtype) and one compute call. When a node fails, the retry helper bans its server and the next attempt
repairs the plan: the node is rebound to a new route over the same blocks (possibly several servers), and what
depends on it runs on the replacement. Backward runs the ``span_backward`` nodes in reverse; a server that lost the
graph recomputes from the inputs the client kept, and a server that is gone gets its forward node repaired: the
span's forward is recomputed elsewhere (keeping graphs) and backpropagated there.

With a client adapter, every call names it by version, and carries its tensors for the hop's blocks only when that
server has not seen this version yet; backward replies carry the adapter's gradients, summed into the parameters'.
A pre-training trainer's ``TrainTag`` goes with every call of its micro-batch, whose routes are drawn stochastically
(replicas in proportion to their speed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.passes import chained
from swarm.client.passes.chain_run import ChainRun
from swarm.client.replies import checked, expected
from swarm.client.tuning.adapters import AdapterDelivery
from swarm.client.verify.calls import CallAudit
from swarm.errors import ActivationsGoneError, AdapterMissingError, BadInputError, StaleStepError, SwarmError
from swarm.hop import Hop
from swarm.plan.compile import repair
from swarm.plan.ir import Plan, SpanBackward, SpanForward, Transfer
from swarm.protocol import BackwardRequest, ForwardRequest
from swarm.rpc.remote import Tensors


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _apply(fn: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``fn.apply(*args)``: torch declares ``Function.apply`` without types, and its output is one tensor here."""
    apply = cast("Callable[..., torch.Tensor]", fn.apply)
    return apply(*args)


def aux_tensors(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> Tensors:
    aux: Tensors = {}
    if attention_mask is not None:
        aux["attention_mask"] = attention_mask.to(torch.int64)
    if position_ids is not None:
        aux["position_ids"] = position_ids.to(torch.int64)
    return aux


class RemoteChain:
    def __init__(self, conn: SwarmConnection, delivery: AdapterDelivery | None = None) -> None:
        self.conn = conn
        self.delivery = delivery  # set when the model tunes remote blocks (LoRA, deep prompts)
        self.last_route: list[Hop] = []
        self.last_plan: Plan | None = None  # the plan of the last call, as repaired
        self.audit = CallAudit(conn, delivery is not None)  # calls drawn for verification (``verify_calls``)
        # a trainer's cross-check of replicas (swarm/client/training/crosscheck.py): (chain, run, node, input, output)
        self.crosscheck: Callable[[RemoteChain, ChainRun, str, torch.Tensor, torch.Tensor], None] | None = None

    def params(self) -> list[torch.nn.Parameter]:
        return self.delivery.adapters.remote_parameters() if self.delivery is not None else []

    def run(self, run: ChainRun, hidden: torch.Tensor) -> torch.Tensor:
        """The chain's output for ``hidden``, differentiable when it needs to be (a kept forward under grad)."""
        params = self.params()
        grad = hidden.requires_grad or any(p.requires_grad for p in params)
        if torch.is_grad_enabled() and grad:
            if run.keep:
                return _apply(_RemoteFn, hidden, self, run, *params)
            # routed over servers that cannot backpropagate: a backward must fail, not skip the servers
            return _apply(_ForwardOnlyFn, hidden, self, run)
        return self.forward(run, hidden)

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
            if not delivery.resend(hop, send):
                raise
            out = self._exchange(hop, request, tensors, True)
        delivery.delivered(hop)
        return out

    def _exchange(
        self, hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors, send: bool = False
    ) -> Tensors:
        adapter: Tensors = {}  # the adapter tensors the server applies, sent or not: a backward returns their grads
        if self.delivery is not None:
            ref, payload = self.delivery.part(hop, send)
            request = request.model_copy(update={"adapter": ref})
            self.conn.remote.traffic["adapter_bytes_sent"] += sum(t.nbytes for t in payload.values())
            adapter = payload or self.delivery.adapters.payload(hop.start, hop.end, _torch_dtype(hop.dtype))
            tensors = dict(tensors, **payload)
        conn = self.conn
        expect = expected(request, tensors, adapter)
        t0 = time.perf_counter()
        call = conn.remote.compute(
            hop, request, tensors, conn.timeout(conn.timing.request_timeout, hop.peer_id), expect.max_bytes
        )
        out = conn.loop.run(checked(hop.peer_id, expect, call))
        first = tensors.get("hidden", tensors.get("grad_output"))
        assert first is not None
        passes = 1 if isinstance(request, ForwardRequest) else 2  # a backward costs about two forwards
        units = passes * first.shape[0] * first.shape[1] * len(hop.span)
        conn.view.observe(hop.peer_id, "forward", time.perf_counter() - t0, units)
        return out

    @property
    def _hop_by_hop(self) -> bool:
        """An adapter or a replica cross-check needs each hop's call from the client."""
        return self.delivery is not None or self.crosscheck is not None

    def _first_input(self, run: ChainRun) -> str:
        """The transfer into the chain's first forward node (its wire dtype is the pass's)."""
        node = run.plan.node(run.forward_ids[0])
        assert isinstance(node, SpanForward)
        return node.inputs[0]

    def _codec(self, run: ChainRun, transfer_id: str) -> torch.dtype:
        node = run.plan.node(transfer_id)
        assert isinstance(node, Transfer)
        return _torch_dtype(node.codec)

    # ---- repair -----------------------------------------------------------------------------------------------------
    def _repair(self, run: ChainRun, node_id: str) -> list[str]:
        """Rebind forward node ``node_id`` (and its backward) to a new route over its blocks, around banned peers."""
        node = run.plan.node(node_id)
        assert isinstance(node, SpanForward)
        received = run.inputs.get(node_id)  # priced for the call's tokens, as its first route was
        tokens = int(received.shape[0] * received.shape[1]) if received is not None else 1
        route = self.conn.view.route(
            node.start, node.end, mode="forward", stochastic=run.train is not None, needs=run.needs, tokens=tokens
        )
        run.generation += 1
        run.plan, fresh = repair(run.plan, node_id, route, run.generation)
        for new_id, hop in zip(fresh, route, strict=True):
            run.hops[new_id] = hop
        for n in run.plan.nodes:
            if isinstance(n, SpanBackward) and n.inputs[1] in fresh:
                run.hops[n.id] = run.hops[n.inputs[1]]
        if node_id in run.forward_ids:
            i = run.forward_ids.index(node_id)
            run.forward_ids[i : i + 1] = fresh
        if node_id in run.inputs:
            run.inputs[fresh[0]] = run.inputs[node_id]
        self.last_route = run.route()
        return fresh

    # ---- forward ----------------------------------------------------------------------------------------------------
    def forward(self, run: ChainRun, hidden: torch.Tensor) -> torch.Tensor:
        self.last_route = run.route()
        if chained.usable(self.conn, run, self._hop_by_hop):
            try:
                out = chained.forward(self.conn, run, hidden.detach(), self._codec(run, self._first_input(run)))
                self.last_plan = run.plan
                return out
            except StaleStepError:
                raise
            except SwarmError as e:  # hop by hop instead, with the usual failover
                chained.fail_over(self.conn, e, "forward")
        out = self._forward_nodes(run, run.forward_ids, hidden.detach())
        self.last_route, self.last_plan = run.route(), run.plan
        return out

    def _forward_nodes(self, run: ChainRun, ids: list[str], x: torch.Tensor) -> torch.Tensor:
        """Forward nodes ``ids`` (repaired in place as they fail) over ``x``."""
        i = 0
        while i < len(ids):

            def attempt(i: int = i, x: torch.Tensor = x) -> tuple[str, torch.Tensor]:
                if ids[i] in run.failed:
                    fresh = self._repair(run, ids[i])
                    if ids is not run.forward_ids:
                        ids[i : i + 1] = fresh
                node_id = ids[i]
                try:
                    return node_id, self._span_forward(run, node_id, x)
                except BaseException:
                    run.failed.add(node_id)  # the retry routes its blocks afresh, around the failed peer
                    raise

            node_id, out = self.conn.retrier.run(attempt, "forward", confirm=True)
            run.inputs[node_id] = x
            if self.crosscheck is not None and run.train is not None:
                self.crosscheck(self, run, node_id, x, out)
            x, i = out, i + 1
        return x

    def _span_forward(self, run: ChainRun, node_id: str, x: torch.Tensor) -> torch.Tensor:
        node = run.plan.node(node_id)
        assert isinstance(node, SpanForward)
        server_id = uuid.uuid4().hex if node.keep else None
        request = ForwardRequest(
            start=node.start, end=node.end, keep_for_backward=node.keep, forward_id=server_id, train=run.train
        )
        wire = self._codec(run, node.inputs[0])
        tensors = dict(run.aux, hidden=x.to(wire))
        reply = self._call(run.hops[node_id], request, tensors)
        if run.train is None and self.audit.due():  # raises naming the hop if two other servers compute otherwise
            # (a pre-training stage's replicas differ between averaging rounds: ``training/crosscheck.py``)
            self.audit.check(self._call, run.hops[node_id], request, tensors, reply)
        run.server_ids[node_id] = server_id
        return reply["hidden"].to(x.dtype)

    # ---- backward ---------------------------------------------------------------------------------------------------
    def backward(
        self, run: ChainRun, grad: torch.Tensor, input_grad: bool = True
    ) -> tuple[torch.Tensor | None, list[Tensors]]:
        """The gradient of the chain's input (None if ``input_grad`` is False), and every backward node's reply
        (which holds the adapter's gradients)."""
        replies: list[Tensors] = []
        if input_grad and chained.usable(self.conn, run, self._hop_by_hop):
            try:
                wire = self._codec(run, self._first_input(run))
                return chained.backward(self.conn, run, grad, wire), replies
            except StaleStepError:
                raise
            except SwarmError as e:  # the forward again hop by hop (stages add a micro-batch's gradient once)
                chained.fail_over(self.conn, e, "backward")
                first = run.forward_ids[0]
                self._forward_nodes(run, run.forward_ids, run.inputs[first])
        g = self._backward_nodes(run, run.backward_ids(run.forward_ids), grad, input_grad, replies)
        self.last_route, self.last_plan = run.route(), run.plan
        return g, replies

    def _backward_nodes(
        self, run: ChainRun, ids: list[str], grad: torch.Tensor, input_grad: bool, replies: list[Tensors]
    ) -> torch.Tensor | None:
        g: torch.Tensor | None = grad
        for k, node_id in enumerate(ids):
            assert g is not None
            g = self._backward_node(run, node_id, g, input_grad or k < len(ids) - 1, replies)
        return g

    def _backward_node(
        self, run: ChainRun, node_id: str, grad: torch.Tensor, input_grad: bool, replies: list[Tensors]
    ) -> torch.Tensor | None:
        """Backpropagate through one backward node. If its server fails, the retry helper bans it and the next
        attempt repairs its forward node: recomputed elsewhere (keeping graphs), backpropagated there."""
        forward_id = run.plan.node(node_id).inputs[1]
        x = run.inputs[forward_id]
        cover = [forward_id]  # the forward nodes that now compute these blocks
        first = [True]

        def attempt() -> tuple[torch.Tensor | None, list[Tensors]]:
            if first[0]:
                first[0] = False
                return self._span_backward(run, node_id, grad, input_grad)
            if cover == [forward_id]:
                cover[:] = self._repair(run, forward_id)
            self._forward_nodes(run, cover, x)
            more: list[Tensors] = []
            g = self._backward_nodes(run, run.backward_ids(cover), grad, input_grad, more)
            return g, more

        g, more = self.conn.retrier.run(attempt, "backward", confirm=True)
        replies.extend(more)
        return g

    def _span_backward(
        self, run: ChainRun, node_id: str, grad: torch.Tensor, input_grad: bool
    ) -> tuple[torch.Tensor | None, list[Tensors]]:
        node = run.plan.node(node_id)
        assert isinstance(node, SpanBackward)
        forward_id = node.inputs[1]
        hop, wire = run.hops[node_id], self._codec(run, node.inputs[0])
        request = BackwardRequest(
            start=node.start,
            end=node.end,
            forward_id=run.server_ids.get(forward_id),
            input_grad=input_grad,
            train=run.train,
        )
        try:
            out = self._call(hop, request, {"grad_output": grad.to(wire)})
        except ActivationsGoneError:  # the server dropped the graph: same server, recompute from our inputs
            resend = dict(run.aux, hidden=run.inputs[forward_id].to(wire))
            out = self._call(hop, request, dict(resend, grad_output=grad.to(wire)))
        if run.train is None and self.audit.due():  # another server recomputes the forward, then the backward
            whole = dict(run.aux, hidden=run.inputs[forward_id].to(wire), grad_output=grad.to(wire))
            self.audit.check(self._call, hop, request, whole, out)
        return (out["grad_input"].to(grad.dtype) if input_grad else None), [out]


class _RemoteFn(torch.autograd.Function):
    # ``ctx: Any``: torch's autograd context takes arbitrary attributes and declares none
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, chain: RemoteChain, run: ChainRun, *adapter_params: torch.Tensor
    ) -> torch.Tensor:
        out = chain.forward(run, hidden)
        ctx.chain, ctx.run, ctx.num_params = chain, run, len(adapter_params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        chain: RemoteChain = ctx.chain
        grad, replies = chain.backward(ctx.run, grad_output.contiguous(), input_grad=ctx.needs_input_grad[0])
        delivery = chain.delivery
        params = delivery.adapters.gradients(replies) if ctx.num_params and delivery is not None else []
        return (grad, None, None, *params)


class _ForwardOnlyFn(torch.autograd.Function):
    """A forward through servers whose runtime cannot run a backward (no backward-capable route existed): the
    outputs are right, and a backward through them is a clear error rather than gradients that skip the blocks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, chain: RemoteChain, run: ChainRun) -> torch.Tensor:
        ctx.route = run.route()
        return chain.forward(run, hidden)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        runtimes = ", ".join(sorted({f"{h.peer_id[-8:]} ({h.runtime})" for h in ctx.route if h.runtime != "torch"}))
        raise BadInputError(
            "this forward ran on servers that cannot run a backward pass ("
            + (runtimes or "no backward capability")
            + "): no server with the 'backward' capability held those blocks. Run under torch.no_grad(), or wait "
            "for such servers"
        )
