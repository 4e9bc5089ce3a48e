"""A pre-training micro-batch's forward and backward as chained passes (``peers/rpc/passes.py``): the trainer sends
the first hop's input and gets the last hop's output, the hops pass the rest to each other (one crossing per stage
and direction instead of two).

Every hop gets its request at once; each answers with the digests of what it ran and returned or pushed on, and the
trainer matches them hop to hop (and against what it sent and got back): a hop that pushed on something other than
what it computed, or ran something other than it was pushed, fails the pass naming both (``WrongReplyError``).

A pass that fails in any way is run again hop by hop through the client (``RemoteChain``, with its failover and
repair): a forward from the start, a backward by running the forward again and then the backward. A stage adds a
micro-batch's weight gradient once (``TrainTag.micro``), so a hop that finished its part of a broken backward is not
counted twice. A stale step is the trainer's business, not a failure: it is raised as it came."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.passes.chain_run import ChainRun
from swarm.client.replies import SLACK_BYTES, distrust, spec
from swarm.errors import BadInputError, StaleStepError, SwarmError, WrongReplyError
from swarm.hop import Hop
from swarm.plan.ir import SpanBackward, SpanForward
from swarm.protocol import RPC_FORWARD, BackwardRequest, ForwardRequest, PassLink, PassReply
from swarm.rpc.commit import digest
from swarm.rpc.remote import Tensors

log = logging.getLogger(__name__)
Call = tuple[Hop, ForwardRequest | BackwardRequest, Tensors, int]  # (hop, request, tensors, largest reply)


def usable(conn: SwarmConnection, run: ChainRun, hop_by_hop: bool) -> bool:
    """Whether this call's chain runs as passes: a pre-training micro-batch over two hops or more, with chaining on,
    nothing that needs it hop by hop (``hop_by_hop``: an adapter, a cross-check), and no hop failed yet."""
    return (
        conn.cfg.chain
        and run.train is not None
        and run.keep
        and not hop_by_hop
        and len(run.forward_ids) > 1
        and not run.failed
    )


def _links(hops: Sequence[Hop], keys: Sequence[str]) -> list[PassLink]:
    n = len(hops)
    return [
        PassLink(
            key=keys[k],
            source=hops[k - 1].peer_id if k else None,
            target=hops[k + 1].peer_id if k + 1 < n else None,
            target_key=keys[k + 1] if k + 1 < n else None,
        )
        for k in range(n)
    ]


def _run(conn: SwarmConnection, calls: list[Call]) -> list[tuple[PassReply, Tensors]]:
    timeout = conn.timeout(conn.timing.request_timeout + conn.timing.open_timeout, calls[0][0].peer_id)

    async def one(hop: Hop, request: ForwardRequest | BackwardRequest, tensors: Tensors, limit: int) -> object:
        try:
            return await conn.remote.call(hop, RPC_FORWARD, request, tensors, timeout, PassReply, limit)
        except SwarmError as e:
            raise distrust(e, hop.peer_id) from None

    async def every() -> list[object]:
        """Every call's reply or error; once one hop failed in a way that dooms the pass (a stale step, an error
        of its own), the others are cancelled rather than left waiting out their wait for a push that will not come
        (a trainer one step behind would otherwise lose ``open_timeout`` per refused pass). A hop that reports it
        waited in vain (``bad_input``) dooms nothing new: the hop that failed it is still to answer."""
        tasks = [asyncio.ensure_future(one(*c)) for c in calls]
        pending: set[asyncio.Future[object]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(not isinstance(t.exception(), BadInputError | None) for t in done):
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        return [None if t.cancelled() else t.exception() or t.result() for t in tasks]  # None: cancelled

    results = conn.loop.run(every())
    errors = [r for r in results if isinstance(r, BaseException)]
    # a stale step first (the trainer catches up, no hop is to blame); then a hop that failed or lied, before the
    # hops that waited in vain for its push and said so (``bad_input``: not theirs to be banned for)
    for kind in (StaleStepError, Exception):
        for error in errors:
            if isinstance(error, kind) and not isinstance(error, BadInputError):
                raise error
    if errors:
        raise errors[0]
    return [r for r in results if isinstance(r, tuple)]  # every item is a (PassReply, Tensors) now


def fail_over(conn: SwarmConnection, e: SwarmError, what: str) -> None:
    """A pass that broke: the hop behind it is banned (as any failed call's), unless it only refused the pass (a
    hop that waited in vain, or one that takes no part in passes); the caller then runs the micro-batch hop by hop."""
    if isinstance(e, BadInputError) or not e.retriable:
        log.info("%s not chained: %s", what, e, extra={"peer": e.peer_id})
        return
    conn.retrier.note_failure(e, f"chained {what}")


def _match(hops: Sequence[Hop], replies: Sequence[PassReply], sent: str, got: str) -> None:
    """The digests hop to hop: what the trainer sent, what each hop ran and passed on, what came back."""
    if replies[0].input_digest != sent:
        raise _blame(hops[0], None, "ran another input than the trainer sent")
    for k in range(len(hops) - 1):
        if replies[k].output_digest != replies[k + 1].input_digest:
            raise _blame(hops[k], hops[k + 1], "passed on another output than it computed, or ran another input")
    if replies[-1].output_digest != got:
        raise _blame(hops[-1], None, "returned another output than it committed to")


def _blame(hop: Hop, other: Hop | None, what: str) -> WrongReplyError:
    names = hop.peer_id + (f" or {other.peer_id}" if other is not None else "")
    error = WrongReplyError(f"chained pass: {names} {what}")
    error.peer_id = hop.peer_id
    return error


def forward(conn: SwarmConnection, run: ChainRun, x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """The chain's output for ``x``, passed hop to hop; the graphs stay on the servers under the pass's keys."""
    ids = list(run.forward_ids)
    hops = [run.hops[i] for i in ids]
    keys = [uuid.uuid4().hex for _ in ids]
    sent = x.to(wire)
    calls: list[Call] = []
    for k, (node_id, link) in enumerate(zip(ids, _links(hops, keys), strict=True)):
        node = run.plan.node(node_id)
        assert isinstance(node, SpanForward)
        request = ForwardRequest(
            start=node.start, end=node.end, keep_for_backward=True, forward_id=keys[k], train=run.train, relay=link
        )
        tensors = dict(run.aux, hidden=sent) if k == 0 else dict(run.aux)
        limit = SLACK_BYTES + (sent.numel() * sent.element_size() if k == len(ids) - 1 else 0)
        calls.append((hops[k], request, tensors, limit))
    out = _pass(conn, hops, calls, sent, "hidden", 1)
    for node_id, key in zip(ids, keys, strict=True):
        run.server_ids[node_id] = key
    run.inputs[ids[0]] = x
    return out.to(x.dtype)


def backward(conn: SwarmConnection, run: ChainRun, grad: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """The gradient of the chain's input, the output gradient ``grad`` passed from the last hop to the first."""
    forward_ids = list(run.forward_ids)
    back_ids = run.backward_ids(forward_ids)
    hops = [run.hops[i] for i in back_ids]
    keys = [uuid.uuid4().hex for _ in back_ids]
    sent = grad.to(wire)
    calls: list[Call] = []
    for k, (node_id, link) in enumerate(zip(back_ids, _links(hops, keys), strict=True)):
        node = run.plan.node(node_id)
        assert isinstance(node, SpanBackward)
        request = BackwardRequest(
            start=node.start,
            end=node.end,
            forward_id=run.server_ids.get(node.inputs[1]),
            input_grad=True,
            train=run.train,
            relay=link,
        )
        tensors = {"grad_output": sent} if k == 0 else {}
        limit = SLACK_BYTES + (sent.numel() * sent.element_size() if k == len(back_ids) - 1 else 0)
        calls.append((hops[k], request, tensors, limit))
    out = _pass(conn, hops, calls, sent, "grad_input", 2)
    return out.to(grad.dtype)


def _pass(
    conn: SwarmConnection, hops: Sequence[Hop], calls: list[Call], sent: torch.Tensor, name: str, passes: int
) -> torch.Tensor:
    """Run the pass's calls; the last hop's ``name`` tensor, checked (shape, finite, digests hop to hop)."""
    t0 = time.perf_counter()
    results = _run(conn, calls)
    out = results[-1][1].get(name)
    if out is None or spec(out) != spec(sent) or not bool(torch.isfinite(out).all()):
        raise _blame(hops[-1], None, f"returned no {name} of the shape it was sent, or a non-finite one")
    _match(hops, [r for r, _ in results], digest(sent), digest(out))
    _observe(conn, hops, time.perf_counter() - t0, sent, passes)
    return out


def _observe(conn: SwarmConnection, hops: Sequence[Hop], seconds: float, first: torch.Tensor, passes: int) -> None:
    """Each hop's share of the pass's time, as the router measures servers (a pass gives no per-hop times)."""
    blocks = sum(len(h.span) for h in hops)
    for hop in hops:
        units = passes * first.shape[0] * first.shape[1] * len(hop.span)
        conn.view.observe(hop.peer_id, "forward", seconds * len(hop.span) / blocks, units)
