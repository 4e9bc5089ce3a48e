"""A robust reduction inside hivemind's all-reduce: one step of CenteredClip (as in BTARD) from the coordinate-wise
median, in place of the plain weighted mean, with hivemind's wire protocol unchanged.

In hivemind's butterfly all-reduce each groupmate reduces a part of the flattened tensors: every sender sends it
that part, and it sends each of them the reduced part back (as a difference from what the sender sent). Each part
lies within one tensor (hivemind splits tensor by tensor), so its values share a scale. The plain mean lets one
sender put the average anywhere; here, for each part, the reducer takes

- the center ``c``: the coordinate-wise median of the senders' parts. With an even count its own part is counted
  twice, which breaks the tie in favour of the one part it knows is honest: a pair's center is its own part;
- the radius ``tau``: an a-priori bound (``PartBound``: a fraction of the center's norm plus a per-element slack) and,
  with three senders or more, at most ``spread`` times the median of the senders' distances to the center;
- the result ``c + mean_i(clip(x_i - c, tau))``, where ``clip`` scales a deviation down to norm ``tau``.

When every part is within ``tau`` of the center nothing is clipped and the result is the plain mean exactly. Whatever
one sender sends, its clipped deviation has norm at most ``tau``, so it moves the result by at most ``2 tau / n``
from what any other value of its would give (``n`` senders), and the result stays within ``tau`` of the center.
While the senders that follow the rule are a majority, the center lies, coordinate by coordinate, between their
values, and (three senders or more) ``tau`` is at most ``spread`` times a distance of one of theirs to it. A part with
a NaN or infinity is left out. Senders' weights are ignored: each sender counts once (a weight is the sender's own
word, and our averagers all send 1).

A reducer that breaks the rule can still return any values for its own part: the owner's post-round check
(``peers/training/span_trainer.py``) is what catches those."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished

from swarm.training.codec import Codec, CodecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartBound:
    """How far an honest replica's part may lie from another's: ``relative`` of the center's norm plus ``absolute``
    per element (in L2 over the part: ``absolute * sqrt(numel)``)."""

    relative: float
    absolute: float = 0.0

    def of(self, center: torch.Tensor) -> float:
        norm = float(torch.linalg.vector_norm(center, dtype=torch.float64))
        return self.relative * norm + self.absolute * math.sqrt(center.numel())


MOMENTS = PartBound(relative=1.0)  # Adam's moments: replicas that saw other micro-batches may differ by their size


@dataclass(frozen=True)
class ClipRule:
    """The reduction's parameters: ``bounds`` by tensor index (tensors past its end take ``default``)."""

    spread: float = 3.0  # honest distances to the median are alike (high dimension): three times the median one
    bounds: tuple[PartBound, ...] = ()
    default: PartBound = MOMENTS

    def bound(self, tensor_index: int) -> PartBound:
        return self.bounds[tensor_index] if 0 <= tensor_index < len(self.bounds) else self.default

    @classmethod
    def for_weights(cls, weights: int, total: int, slack: float) -> ClipRule:
        """The first ``weights`` of ``total`` tensors are weights, whose replicas differ by at most ``slack`` per
        element (AdamW moves a weight by about lr a step); the rest are Adam's moments."""
        return cls(bounds=(PartBound(relative=0.0, absolute=slack),) * weights + (MOMENTS,) * (total - weights))


def centered_clip(
    parts: Sequence[torch.Tensor], own: int | None, bound: PartBound, spread: float
) -> tuple[torch.Tensor, list[bool]]:
    """The reduced part, and for each of ``parts`` whether it was clipped or left out (non-finite). ``own``: the
    index in ``parts`` of the reducer's own part, if it sent one."""
    kept = [i for i, p in enumerate(parts) if bool(torch.isfinite(p).all())]
    outcast = [i not in kept for i in range(len(parts))]
    if not kept:
        return torch.zeros_like(parts[0]) if parts else torch.zeros(0), outcast
    dtype = parts[kept[0]].dtype
    stack = torch.stack([parts[i].double() for i in kept])
    voters = stack
    if len(kept) % 2 == 0 and own is not None and own in kept:
        voters = torch.cat([stack, stack[kept.index(own)].unsqueeze(0)])
    center = voters.median(dim=0).values  # an odd count, or (no own part) the lower of the two middle values
    deviations = stack - center
    distances = torch.linalg.vector_norm(deviations.flatten(1), dim=1)
    tau = bound.of(center)
    if len(kept) >= 3:
        tau = min(tau, spread * float(distances.sort().values[len(kept) // 2]))
    scale = torch.where(distances > tau, tau / distances.clamp_min(1e-300), torch.ones_like(distances))
    result = center + (deviations * scale.view(-1, *([1] * (stack.dim() - 1)))).mean(dim=0)
    clipped = {i for i, d in zip(kept, distances.tolist(), strict=True) if d > tau}
    return result.to(dtype), [outcast[i] or i in clipped for i in range(len(parts))]


class RobustPartReducer(TensorPartReducer):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's ``TensorPartReducer`` (its bookkeeping of senders and failures kept), collecting each sender's part
    and reducing them with ``centered_clip`` where hivemind sums them into a weighted mean."""

    # hivemind's attributes, set by its __init__ through reset_accumulators
    current_part_index: int
    current_part_accumulated_from: int
    num_current_senders: int
    current_part_future: asyncio.Future[torch.Tensor]
    accumulator: None
    denominator: float

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        rule: ClipRule,
        own_sender: int | None,
        part_tensors: Sequence[int],
    ) -> None:
        self.rule, self.own_sender, self.part_tensors = rule, own_sender, list(part_tensors)
        self.received: list[tuple[int, torch.Tensor]] = []
        self.clipped: Counter[int] = Counter()  # parts clipped or left out, by sender index
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        assert self.current_part_accumulated_from == self.num_current_senders or self.current_part_index == -1
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self.received = []
        self.accumulator = None  # hivemind's finalize deletes it
        self.denominator = 0.0

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """As hivemind's, but the part is kept for the reduction rather than added to a sum (``weight`` ignored)."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.received.append((sender_index, tensor_part))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        result: torch.Tensor = await future
        return result

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self.reduce())
            self.reset_accumulators()

    def reduce(self) -> torch.Tensor:
        if not self.received:  # every sender failed: nobody waits for this part
            return torch.zeros(self.part_shapes[self.current_part_index])
        senders = [s for s, _ in self.received]
        own = senders.index(self.own_sender) if self.own_sender in senders else None
        bound = self.rule.bound(self.part_tensors[self.current_part_index])
        result, clipped = centered_clip([p for _, p in self.received], own, bound, self.rule.spread)
        self.clipped.update(s for s, c in zip(senders, clipped, strict=True) if c)
        return result


class RobustAllReduceRunner(AllReduceRunner):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's ``AllReduceRunner`` (the same messages and protocol), its parts reduced by ``RobustPartReducer``
    and sent through ``codec`` (``swarm/training/codec.py``): a reducer returns the reduced part itself, encoded
    once, and keeps of its own result what its groupmates decode, so every groupmate ends with the same values."""

    tensor_part_reducer: TensorPartReducer

    def __init__(self, *, rule: ClipRule, codec: Codec, **kwargs: object) -> None:  # the rest: hivemind's
        super().__init__(compression=codec, **kwargs)
        self.codec = codec
        index = self.ordered_peer_ids.index(self.peer_id)
        # the tensor each of this peer's parts comes from (hivemind keys a part's info by its tensor's index)
        tensors = [info.key for _, info in self.tensor_part_container._input_parts_by_peer[index]]
        plain = self.tensor_part_reducer
        plain.finished.set()  # never used: its finalize must not warn that it received nothing
        self.tensor_part_reducer = RobustPartReducer(
            plain.part_shapes,
            len(self.sender_peer_ids),
            rule=rule,
            own_sender=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
            part_tensors=[k if isinstance(k, int) else -1 for k in tensors],
        )

    def clipped_peers(self) -> dict[str, int]:
        """How many of the parts this peer reduced each groupmate had clipped or left out."""
        reducer = self.tensor_part_reducer
        assert isinstance(reducer, RobustPartReducer)
        return {self.sender_peer_ids[s].to_base58(): n for s, n in reducer.clipped.items()}

    async def _communicate_with_peer(self, peer_id: Any) -> None:  # Any: hivemind's PeerID (untyped there)
        """Send this peer's parts to the groupmate that reduces them and take back the reduced values (as hivemind's,
        with the codec and its replies of values)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        raw = [part for part, _ in container._input_parts_by_peer[peer_index]]
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                reduced = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, part, weight=self.weight
                )
                container.register_processed_part(peer_index, part_index, self.codec.roundtrip(reduced) - part)
            return
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            async for message in aiter_with_timeout(stream, self.reducer_timeout):
                if message.code != averaging_pb2.AVERAGED_PART or part_index >= len(raw):
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                reduced = self.codec.extract_as(message.tensor_part, raw[part_index].shape)
                container.register_processed_part(peer_index, part_index, reduced - raw[part_index])
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"{peer_id} sent {part_index} of {len(raw)} parts")
        except BaseException:
            container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:  # Any: hivemind's messages
        """Reduce a groupmate's parts as they come and send back each reduced part (hivemind sends differences)."""
        part_index = 0
        shapes = self.tensor_part_reducer.part_shapes
        try:
            async for message in stream:
                if part_index >= len(shapes):
                    break
                try:
                    part = self.codec.extract_as(message.tensor_part, shapes[part_index])
                except CodecError as e:
                    log.warning("averaging: a groupmate's part does not decode: %s", e)
                    break
                try:
                    reduced = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=message.weight
                    )
                except BannedException:
                    break
                part_index += 1
                reply = self.codec.compress(reduced)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
