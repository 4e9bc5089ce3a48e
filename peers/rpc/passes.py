"""Chained training passes: a pre-training micro-batch's forward goes server to server down the stages and its
backward back up, the trainer sending the first hop's input and receiving the last hop's output (one network
crossing per stage and direction, not two).

The trainer sends every hop of the pass its request at once (``ForwardRequest`` / ``BackwardRequest`` with a
``PassLink``). The first hop's carries the input; every other hop's names the peer that will push its input
(``source``) and waits for that push (``swarm.push``, a ``PassPush``) under the key the trainer gave it. A hop runs
its compute as any request of the trainer's (admitted, counted and limited as the trainer's), then pushes its output
to the peer the trainer named (``target``, under ``target_key``), dialled at the addresses that peer's own signed
record announces, and answers the trainer with the digests of its input and output (``PassReply``); the last hop
answers with its output. The trainer matches the digests hop to hop: a hop that pushed something else than it
computed, or that ran something else than it was pushed, shows at once.

A push is taken only from the peer the trainer's request names as ``source``, and only if that peer serves the
blocks next to this hop's by its own signed record. A push that arrives before its request waits (bounded in number,
per trainer and in bytes, counted as that trainer's in the byte budget: a trainer that has servers push for passes
it never asks for fills only its own share) for ``Timing.open_timeout``; a request waits as
long for its push, then fails (the trainer then runs the micro-batch hop by hop, and a stage adds a micro-batch's
gradient only once: ``TrainTag.micro``)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peers.rpc.directory import ServerDirectory
from peers.serving.pass_service import PassService
from swarm import wire
from swarm.config import Timing
from swarm.errors import BadInputError, UnknownHopError
from swarm.protocol import BackwardRequest, ForwardRequest, PassPush, PassReply
from swarm.records import ServerRecord
from swarm.rpc.commit import digest

log = logging.getLogger(__name__)
MAX_WAITING_PER_CALLER = 32  # requests of one trainer waiting for their pushed input
MAX_EARLY = 256  # pushes that arrived before their request, all pushers together
MAX_EARLY_PER_CLIENT = 32  # ...and per trainer whose passes they are (a trainer cannot crowd out another's)
MAX_EARLY_BYTES = 64 << 20
PUSHED = {"forward": "hidden", "backward": "grad_output"}  # the one tensor a pass pushes, by direction
Send = Callable[[ServerRecord, PassPush, dict[str, torch.Tensor], str], None]  # (to, push, tensors, holder)


@dataclass
class _Slot:
    source: str | None = None  # who may push, once the trainer's request said so
    future: asyncio.Future[torch.Tensor] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    early: tuple[str, torch.Tensor, int] | None = None  # (pusher, tensor, bytes) of a push before its request
    claimed: wire.ByteBudget | None = None


class PassBox:
    """Pushed inputs meeting the requests that wait for them, keyed by (trainer, key)."""

    def __init__(self, timing: Timing, budget: wire.ByteBudget | None) -> None:
        self.timing, self.budget = timing, budget
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._waiting: Counter[str] = Counter()  # by trainer
        self._early: Counter[str] = Counter()  # by trainer
        self._early_bytes = 0

    async def take(self, client: str, key: str, source: str) -> torch.Tensor:
        """The tensor ``source`` pushed for ``client``'s request ``key`` (waiting for it up to ``open_timeout``)."""
        slot = self._slots.get((client, key))
        if slot is not None and slot.source is not None:
            raise BadInputError(f"a request of pass key {key} already waits here")
        if slot is None:
            if self._waiting[client] >= MAX_WAITING_PER_CALLER:
                raise BadInputError(f"{MAX_WAITING_PER_CALLER} requests of this trainer already wait for a push")
            slot = self._slots[(client, key)] = _Slot()
        slot.source = source
        self._waiting[client] += 1
        try:
            if slot.early is not None:
                pusher, tensor, _ = slot.early
                if pusher != source:
                    raise BadInputError(f"pass key {key} was pushed by {pusher}, not by {source}")
                return tensor
            try:
                async with asyncio.timeout(self.timing.open_timeout):
                    return await slot.future
            except TimeoutError:
                raise BadInputError(f"{source} pushed nothing for pass key {key} within the wait") from None
        finally:
            self._waiting[client] -= 1
            if self._waiting[client] <= 0:
                del self._waiting[client]
            self._drop((client, key))

    def put(self, pusher: str, push: PassPush, tensor: torch.Tensor) -> None:
        """A push: to its waiting request if its source is ``pusher``, else kept a while for the request to come."""
        slot = self._slots.get((push.client, push.key))
        if slot is not None and slot.source is not None:
            if pusher != slot.source:
                raise BadInputError(f"{pusher} is not the hop the trainer named before pass key {push.key}")
            if slot.future.done():
                raise BadInputError(f"pass key {push.key} was pushed already")
            slot.future.set_result(tensor)
            return
        if slot is not None:
            raise BadInputError(f"pass key {push.key} was pushed already")
        nbytes = tensor.numel() * tensor.element_size()
        if (
            len(self._slots) >= MAX_EARLY
            or self._early[push.client] >= MAX_EARLY_PER_CLIENT
            or self._early_bytes + nbytes > MAX_EARLY_BYTES
        ):
            raise BadInputError("too many pushes wait for their requests")
        if self.budget is not None:
            self.budget.take(nbytes, push.client)  # BusyError beyond the trainer's share: the push is dropped
        slot = self._slots[(push.client, push.key)] = _Slot(early=(pusher, tensor, nbytes), claimed=self.budget)
        self._early[push.client] += 1
        self._early_bytes += nbytes
        asyncio.get_running_loop().call_later(self.timing.open_timeout, self._expire, (push.client, push.key), slot)

    def _expire(self, key: tuple[str, str], slot: _Slot) -> None:
        if self._slots.get(key) is slot and slot.source is None:  # never asked for
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        slot = self._slots.pop(key, None)
        if slot is None or slot.early is None:
            return
        client = key[0]
        _, _, nbytes = slot.early
        slot.early = None
        self._early[client] -= 1
        if self._early[client] <= 0:
            del self._early[client]
        self._early_bytes -= nbytes
        if slot.claimed is not None:
            slot.claimed.give(nbytes, client)


class Passes:
    """This server's part of chained training passes: requests with a ``PassLink``, and the pushes they wait for."""

    def __init__(
        self,
        service: PassService,
        directory: ServerDirectory,
        timing: Timing,
        send: Send,
        budget: wire.ByteBudget | None = None,
    ) -> None:
        """``send(record, push, tensors, holder)``: push to the peer of ``record`` (``StepPusher.send_pass``)."""
        self.service, self.directory, self.send = service, directory, send
        self.box = PassBox(timing, budget)

    async def run(
        self, req: ForwardRequest | BackwardRequest, tensors: dict[str, torch.Tensor], caller: str
    ) -> tuple[PassReply, dict[str, torch.Tensor]]:
        """Run this hop's part of the pass; the reply and the tensors that go back to the trainer."""
        link = req.relay
        assert link is not None
        forward = isinstance(req, ForwardRequest)
        name = PUSHED["forward" if forward else "backward"]
        if req.train is None or req.adapter is not None or req.codec is not None:
            raise BadInputError("a chained pass is a pre-training micro-batch's, exact, without an adapter")
        if link.source is not None:
            if name in tensors:
                raise BadInputError(f"a hop whose input is pushed takes no {name!r} from the trainer")
            before = req.start - 1 if forward else req.end  # the blocks the pusher must serve
            if before < 0 or await self.directory.server_at(link.source, before) is None:
                raise BadInputError(f"{link.source} announces no record serving block {before}")
            tensors = dict(tensors, **{name: await self.box.take(caller, link.key, link.source)})
        received = tensors.get(name)
        if received is None:
            raise BadInputError(f"a chained pass's first hop needs {name!r}")
        if forward:
            assert isinstance(req, ForwardRequest)
            if not req.keep_for_backward or req.forward_id != link.key:
                raise BadInputError("a chained forward keeps its graph under its pass key")
            out = await self.service.forward(req, tensors, caller)
            result: torch.Tensor | None = out.pop("hidden")
        else:
            assert isinstance(req, BackwardRequest)
            out = await self.service.backward(req, tensors, caller)
            result = out.pop("grad_input", None)
        reply = PassReply(input_digest=digest(received), output_digest=digest(result) if result is not None else "")
        if link.target is None:
            return reply, ({**out, ("hidden" if forward else "grad_input"): result} if result is not None else out)
        if result is None or link.target_key is None:
            raise BadInputError("a hop that pushes on needs an output and the key to push it under")
        after = req.end if forward else req.start - 1  # the blocks the next hop of the pass must serve
        record = await self.directory.server_at(link.target, after) if after >= 0 else None
        if record is None:
            raise UnknownHopError(f"the pass's next hop {link.target} announces no record serving block {after}")
        push = PassPush(client=caller, key=link.target_key)
        self.send(record, push, {name: result}, caller)
        return reply, out
