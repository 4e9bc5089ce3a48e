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
blocks next to this hop's by its own signed record. Only a server that runs a training stage takes pushes at all
(an inference-only one refuses them, and chained requests, at once). A push that arrives before its request waits
for ``Timing.open_timeout``, kept only if its pusher (the push stream's authenticated peer id, never a name the push
carries) announces, in a record its own key signed, blocks next to this server's span (before it for an activation,
after it for a gradient), and counted as that pusher's: in the byte budget, and in an early-push room bounded in
pushes and bytes per pusher (and per trainer a pusher names), so one identity, whatever trainers it names, holds at
most its share. A request waits as long for its push, then fails (the trainer then runs the micro-batch hop by hop,
and a stage adds a micro-batch's gradient only once: ``TrainTag.micro``). Every push's outcome is counted
(``PeerMetrics.pass_pushes``); a refused one is logged (the push stream is one-way: there is no one to answer)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from peers.rpc.directory import ServerDirectory
from peers.serving.counters import PeerMetrics
from peers.serving.pass_service import PassService
from swarm import wire
from swarm.config import Timing
from swarm.errors import BadInputError, BusyError, UnknownHopError
from swarm.protocol import BackwardRequest, ForwardRequest, PassPush, PassReply
from swarm.records import ServerRecord
from swarm.rpc.commit import digest

log = logging.getLogger(__name__)
MAX_WAITING_PER_CALLER = 32  # requests of one trainer waiting for their pushed input
MAX_EARLY = 256  # pushes that arrived before their request, all pushers together
MAX_EARLY_PER_PUSHER = 32  # ...of one pusher (its authenticated peer id), whatever trainers its pushes name
# ...of one pusher for one trainer: a trainer that has an honest stage push for passes it never asks for fills only
# its part of that stage's share (a trainer keeps ``pipeline_depth`` micro-batches in flight, 2 by default)
MAX_EARLY_PER_CLIENT = 8
MAX_EARLY_BYTES = 64 << 20  # their tensor bytes, all pushers together (at most a quarter of the byte budget)
EARLY_SHARES = 4  # one pusher holds at most this fraction of those bytes
# What becomes of a push (``PeerMetrics.pass_pushes``): given to its waiting request, kept for one to come, or
# refused: this server runs no training stage, the pusher announces no record next to its span, the pusher's share
# (or the room of all pushers together, or its share of the byte budget) is full, or the push itself is wrong.
OUTCOMES = ("taken", "kept", "no_stage", "no_record", "share", "full", "busy", "bad")
PUSHED = {"forward": "hidden", "backward": "grad_output"}  # the one tensor a pass pushes, by direction
Send = Callable[[ServerRecord, PassPush, dict[str, torch.Tensor], str], None]  # (to, push, tensors, holder)


class PushRefused(BadInputError):
    """A push refused, and why (``reason``: one of ``OUTCOMES``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Slot:
    source: str | None = None  # who may push, once the trainer's request said so
    future: asyncio.Future[torch.Tensor] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    early: tuple[str, torch.Tensor, int] | None = None  # (pusher, tensor, bytes) of a push before its request
    claimed: wire.ByteBudget | None = None


def _less(counter: Counter[Any], key: object, n: int = 1) -> None:
    counter[key] -= n
    if counter[key] <= 0:
        del counter[key]  # a pusher holding nothing costs no memory


class PassBox:
    """Pushed inputs meeting the requests that wait for them, keyed by (trainer, key); pushes that came first are
    counted, and bounded, by their pusher."""

    def __init__(self, timing: Timing, budget: wire.ByteBudget | None) -> None:
        self.timing, self.budget = timing, budget
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._waiting: Counter[str] = Counter()  # requests, by trainer
        self._early: Counter[str] = Counter()  # early pushes, by pusher
        self._early_for: Counter[tuple[str, str]] = Counter()  # ...by pusher and the trainer it names
        self._early_bytes: Counter[str] = Counter()  # ...their bytes, by pusher
        self._early_total = self._early_total_bytes = 0
        self.max_bytes = MAX_EARLY_BYTES if budget is None else min(MAX_EARLY_BYTES, budget.limit // 4)
        self.max_pusher_bytes = self.max_bytes // EARLY_SHARES
        self.peak = 0  # the most early pushes one pusher ever held at once (metrics)

    def held_by(self, pusher: str) -> tuple[int, int]:
        """The early pushes ``pusher`` holds here now, and their bytes."""
        return self._early[pusher], self._early_bytes[pusher]

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
            _less(self._waiting, client)
            self._drop((client, key))

    def put(self, pusher: str, push: PassPush, tensor: torch.Tensor) -> str:
        """A push from ``pusher``: to its waiting request if that named ``pusher`` ("taken"), else kept a while for
        the request to come ("kept"), within ``pusher``'s share; ``PushRefused`` or ``BusyError`` otherwise."""
        slot = self._slots.get((push.client, push.key))
        if slot is not None and slot.source is not None:
            if pusher != slot.source:
                raise PushRefused("bad", f"{pusher} is not the hop the trainer named before pass key {push.key}")
            if slot.future.done():
                raise PushRefused("bad", f"pass key {push.key} was pushed already")
            slot.future.set_result(tensor)
            return "taken"
        if slot is not None:
            raise PushRefused("bad", f"pass key {push.key} was pushed already")
        nbytes = tensor.numel() * tensor.element_size()
        if (
            self._early[pusher] >= MAX_EARLY_PER_PUSHER
            or self._early_for[(pusher, push.client)] >= MAX_EARLY_PER_CLIENT
            or self._early_bytes[pusher] + nbytes > self.max_pusher_bytes
        ):
            raise PushRefused(
                "share",
                f"this pusher's pushes waiting for their requests fill its share ({MAX_EARLY_PER_PUSHER} pushes, "
                f"{MAX_EARLY_PER_CLIENT} for one trainer, {self.max_pusher_bytes} bytes)",
            )
        if self._early_total >= MAX_EARLY or self._early_total_bytes + nbytes > self.max_bytes:
            raise PushRefused("full", "too many pushes wait for their requests")
        if self.budget is not None:
            self.budget.take(nbytes, pusher)  # BusyError beyond the pusher's share of the byte budget: dropped
        slot = self._slots[(push.client, push.key)] = _Slot(early=(pusher, tensor, nbytes), claimed=self.budget)
        self._early[pusher] += 1
        self._early_for[(pusher, push.client)] += 1
        self._early_bytes[pusher] += nbytes
        self._early_total += 1
        self._early_total_bytes += nbytes
        self.peak = max(self.peak, self._early[pusher])
        asyncio.get_running_loop().call_later(self.timing.open_timeout, self._expire, (push.client, push.key), slot)
        return "kept"

    def _expire(self, key: tuple[str, str], slot: _Slot) -> None:
        if self._slots.get(key) is slot and slot.source is None:  # never asked for
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        slot = self._slots.pop(key, None)
        if slot is None or slot.early is None:
            return
        pusher, _, nbytes = slot.early
        slot.early = None
        _less(self._early, pusher)
        _less(self._early_for, (pusher, key[0]))
        _less(self._early_bytes, pusher, nbytes)
        self._early_total -= 1
        self._early_total_bytes -= nbytes
        if slot.claimed is not None:
            slot.claimed.give(nbytes, pusher)


class Passes:
    """This server's part of chained training passes: requests with a ``PassLink``, and the pushes they wait for."""

    def __init__(
        self,
        service: PassService,
        directory: ServerDirectory,
        timing: Timing,
        send: Send,
        budget: wire.ByteBudget | None = None,
        metrics: PeerMetrics | None = None,
        peer_id: str = "",
    ) -> None:
        """``send(record, push, tensors, holder)``: push to the peer of ``record`` (``StepPusher.send_pass``);
        ``peer_id``: this server's own (a pass that names it twice in a row pushes to itself)."""
        self.service, self.directory, self.send = service, directory, send
        self.metrics, self.peer_id = metrics, peer_id
        self.box = PassBox(timing, budget)

    def _training(self) -> None:
        if self.service.loaded.learner is None:
            raise PushRefused("no_stage", "this server runs no training stage: it takes no part in chained passes")

    async def accept(self, pusher: str, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
        """A push (``swarm.push``) from ``pusher``, the push stream's authenticated peer id: given to its waiting
        request, kept for it, or refused; counted by outcome either way, and a refusal logged, not raised (a push
        stream is one-way, and one refused push must not end the steps and passes behind it on the same stream)."""
        why: Exception | None = None
        try:
            outcome = await self._accept(pusher, meta, tensors)
        except PushRefused as e:
            outcome, why = e.reason, e
        except BusyError as e:
            outcome, why = "busy", e
        except (BadInputError, ValidationError) as e:
            outcome, why = "bad", e
        if self.metrics is not None:
            self.metrics.pass_pushes[outcome] += 1
            self.metrics.pass_early_peak = self.box.peak
        if why is not None:
            log.info("pass push refused (%s): %s", outcome, why, extra={"peer": pusher})

    async def _accept(self, pusher: str, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> str:
        push = PassPush.model_validate(meta)
        if len(tensors) != 1 or next(iter(tensors)) not in PUSHED.values():
            raise PushRefused("bad", "a pass push carries one tensor, hidden or grad_output")
        ((name, tensor),) = tensors.items()
        self._training()
        held = self.service.loaded.held
        if held is None:
            raise PushRefused("no_stage", "this server serves no blocks right now (joining or standby)")
        if pusher != self.peer_id:
            # an activation comes from a server of a block before one of ours, a gradient from one after; a
            # request checks its exact block again (``run``)
            first, end = (held.start - 1, held.end - 1) if name == "hidden" else (held.start + 1, held.end + 1)
            if await self.directory.server_in(pusher, first, end) is None:
                raise PushRefused("no_record", f"{pusher} announces no record serving a block next to {held}")
        return self.box.put(pusher, push, tensor)

    async def run(
        self, req: ForwardRequest | BackwardRequest, tensors: dict[str, torch.Tensor], caller: str
    ) -> tuple[PassReply, dict[str, torch.Tensor]]:
        """Run this hop's part of the pass; the reply and the tensors that go back to the trainer."""
        link = req.relay
        assert link is not None
        forward = isinstance(req, ForwardRequest)
        name = PUSHED["forward" if forward else "backward"]
        self._training()  # before waiting for a push this server would refuse
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
