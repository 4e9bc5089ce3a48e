"""An inference session: one server-side KV cache per hop of a chain, kept in step.

Each hop remembers what it was sent. When a hop fails (error, dropped connection, or no answer within the step
timeout), the retry helper bans its peer, and the next attempt routes a replacement for just that hop's blocks
(possibly several peers) and replays the remembered inputs onto it, so the new servers rebuild the cache and the
session goes on from the same position. A hop that stays far slower than its server announced is moved the same
way, if another route exists."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from swarm.client.remote import InferenceStream
from swarm.client.routing import Hop
from swarm.client.sequential import RemoteBlocks
from swarm.errors import AdapterMissingError, CacheFullError, MissingBlocksError, SessionLengthError, SwarmError
from swarm.protocol import PROTOCOL_VERSION, OpenSession

log = logging.getLogger(__name__)

SLOW_STEPS = 3  # consecutive slow steps before a hop is moved


@dataclass
class _HopState:
    hop: Hop
    stream: InferenceStream | None = None
    opened: bool = False
    broken: bool = False  # failed (or too slow): the next attempt replaces it
    slow_steps: int = 0
    send_adapter: bool = False  # open with the adapter's tensors even if the server should have them
    inputs: list[torch.Tensor] = field(default_factory=list)  # hidden sent at each step (client dtype)
    positions: list[torch.Tensor] = field(default_factory=list)


class InferenceSession:
    def __init__(self, blocks: RemoteBlocks, max_length: int, batch_size: int) -> None:
        self.blocks = blocks
        self.max_length = max_length
        self.batch_size = batch_size
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self._hops: list[_HopState] = []
        self._mask: torch.Tensor | None = None  # full attention mask so far, when padding is involved
        self.tokens: torch.Tensor | None = None  # token ids so far: kept by the model wrapper, never sent
        self.conversation: torch.Tensor | None = None  # the last generate's whole output
        self.prefix = 0  # trainable prompt positions the model put in front of the first step (prompt tuning)
        self.closed = False

    @property
    def route(self) -> list[Hop]:
        return [h.hop for h in self._hops]

    @property
    def failovers(self) -> int:
        return self.blocks.retrier.failovers

    # ---- routing ------------------------------------------------------------------------------------------------
    def _new_hops(self, start: int, end: int) -> list[_HopState]:
        need = self.batch_size * self.max_length
        try:
            route = self.blocks.view.route(start, end, mode="inference", min_cache_tokens=need)
        except MissingBlocksError:
            self.blocks.view.route(start, end, mode="inference")  # raises if the blocks themselves are missing
            error = CacheFullError(
                f"no server of blocks {start}:{end} has KV-cache room for a session of {need} tokens "
                f"(batch {self.batch_size} x max_length {self.max_length}); try a shorter max_length or later"
            )
            error.retriable = False
            raise error from None
        return [_HopState(hop) for hop in route]

    def _replace(self, index: int) -> None:
        """Route new servers for hop ``index``'s blocks and replay its history onto them."""
        old = self._hops[index]
        if old.stream is not None:
            old.stream.close()
        fresh = self._new_hops(old.hop.start, old.hop.end)
        log.info(
            "replacing a hop",
            extra={"peer": old.hop.peer_id, "span": f"{old.hop.start}:{old.hop.end}", "session": self.session_id},
        )
        if old.inputs:
            hidden = torch.cat(old.inputs, dim=1)
            positions = torch.cat(old.positions, dim=1)
            mask = None if self._mask is None else self._mask[:, : self.position]
            try:
                for state in fresh:
                    state.inputs, state.positions = [hidden], [positions]
                    hidden = self._exchange(state, hidden, mask, positions, 0)
            except BaseException:
                for state in fresh:
                    if state.stream is not None:
                        state.stream.close()
                raise
        self._hops[index : index + 1] = fresh

    # ---- one hop --------------------------------------------------------------------------------------------------
    def _message(self, state: _HopState, hidden, mask, positions, position: int) -> tuple[dict, dict]:
        hop = state.hop
        meta: dict = {"step": {"position": position}}
        tensors = {"hidden": hidden.to(getattr(torch, hop.dtype))}
        if not state.opened:
            # the adapter is bound to the server's session at open: named by version, its tensors sent only when
            # that server lacks this version (or when a reference came back adapter_missing: state.send_adapter)
            adapters = self.blocks._remote_adapters()
            send = adapters is not None and (state.send_adapter or self.blocks.adapter_needs_sending(hop))
            opening = OpenSession(
                session_id=uuid.uuid4().hex,  # per hop: one server may hold two hops of this session
                start=hop.start,
                end=hop.end,
                max_length=self.max_length,
                batch_size=self.batch_size,
                adapter=adapters.ref(send) if adapters is not None else None,
            )
            meta.update(protocol_version=PROTOCOL_VERSION, open=opening.model_dump())
            if send:
                tensors.update(adapters.payload(hop.start, hop.end, tensors["hidden"].dtype))
        if mask is not None:
            tensors["attention_mask"] = mask
        if positions is not None:
            tensors["position_ids"] = positions
        return meta, tensors

    def _timeout(self, hidden: torch.Tensor) -> float:
        timing = self.blocks.timing
        return timing.step_timeout if hidden.shape[0] * hidden.shape[1] <= 8 else timing.request_timeout

    def _observe(self, state: _HopState, elapsed: float, tokens: int) -> None:
        """Feed routing's latency estimates, and move a hop that stays far slower than its server announced when
        another route is expected to be at least twice as fast (no ban: a slow peer is still a working one)."""
        view, hop = self.blocks.view, state.hop
        expected = hop.step_seconds * tokens + view.hop_latency
        view.observe(hop.peer_id, elapsed, expected)
        state.slow_steps = state.slow_steps + 1 if elapsed > self.blocks.timing.slow_factor * expected else 0
        if state.slow_steps < SLOW_STEPS:
            return
        state.slow_steps = 0
        try:
            other = view.route(hop.start, hop.end, mode="inference", exclude=frozenset({hop.peer_id}), wait=False)
        except SwarmError:
            return  # nowhere else to go
        estimate = sum(view.hop_latency + view.latency.get(h.peer_id, 0.0) + h.step_seconds * tokens for h in other)
        if estimate < elapsed / 2:
            log.warning("moving a slow hop", extra={"peer": hop.peer_id, "session": self.session_id})
            state.broken = True

    def _exchange(self, state: _HopState, hidden, mask, positions, position: int) -> torch.Tensor:
        timing, loop = self.blocks.timing, self.blocks.loop
        opening = not state.opened
        meta, tensors = self._message(state, hidden, mask, positions, position)
        if opening:
            state.stream = loop.run(self.blocks.remote.open_stream(state.hop), timing.open_timeout)
            state.opened = True
        t0 = time.perf_counter()
        try:
            out = loop.run(state.stream.exchange(meta, tensors, self._timeout(hidden)))["hidden"]
        except AdapterMissingError:
            if not opening or state.send_adapter:
                raise
            # the server dropped its cached copy: open this hop again, with the adapter's tensors this time
            self.blocks.adapter_delivered(state.hop, False)
            state.opened, state.send_adapter = False, True
            return self._exchange(state, hidden, mask, positions, position)
        if opening and self.blocks._remote_adapters() is not None:
            self.blocks.adapter_delivered(state.hop)
        self._observe(state, time.perf_counter() - t0, hidden.shape[1])
        return out.to(hidden.dtype)

    async def _chain(self, hidden, mask, positions, outs: list[torch.Tensor], times: list[float]) -> None:
        """The common case in one trip to the event loop: every hop open and healthy. Stops at the first hop that
        is not; ``outs`` holds what the hops before it returned."""
        h = hidden
        for state in self._hops:
            if not state.opened or state.broken:
                return
            meta, tensors = self._message(state, h, mask, positions, self.position)
            t0 = time.perf_counter()
            out = await state.stream.exchange(meta, tensors, self._timeout(hidden))
            times.append(time.perf_counter() - t0)
            h = out["hidden"].to(hidden.dtype)
            outs.append(h)

    # ---- a step through every hop ---------------------------------------------------------------------------------
    def step(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run ``hidden`` [batch, n, hidden] through every block; ``attention_mask`` covers all positions so far."""
        if self.closed:
            raise SessionLengthError("this inference session is closed")
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise SessionLengthError(f"session opened for batch {self.batch_size}, got batch {batch}")
        if self.position + n > self.max_length:
            raise SessionLengthError(
                f"session of max_length {self.max_length} is at {self.position}; {n} more tokens do not fit"
            )
        if attention_mask is not None:
            self._mask = attention_mask.to(torch.int64)
        # replays need explicit positions even where the server could infer them
        explicit = position_ids if position_ids is not None else torch.arange(self.position, self.position + n)
        explicit = explicit.expand(batch, -1) if explicit.ndim == 1 else explicit
        if not self._hops:
            self._hops = self.blocks.retrier.run(lambda: self._new_hops(0, self.blocks.view.num_blocks), "route")

        outs: list[torch.Tensor] = []
        times: list[float] = []
        try:
            self.blocks.loop.run(self._chain(hidden, self._mask, position_ids, outs, times))
        except SwarmError as e:
            failed = self._hops[len(outs)]
            failed.broken = True
            if not e.retriable:
                raise
            self.blocks.retrier.note_failure(e, "inference step")
        h = hidden
        for state, out, elapsed in zip(self._hops, outs, times, strict=False):
            state.inputs.append(h)
            state.positions.append(explicit)
            self._observe(state, elapsed, n)
            h = out
        index = len(outs)
        while index < len(self._hops):  # opening hops, and replacing failed ones, under the retry helper

            def attempt(index=index, h=h):
                if self._hops[index].broken:
                    self._replace(index)
                state = self._hops[index]
                try:
                    return state, self._exchange(state, h, self._mask, position_ids, self.position)
                except Exception:
                    state.broken = True
                    if state.stream is not None:
                        state.stream.close()
                    raise

            state, out = self.blocks.retrier.run(attempt, "inference step")
            state.inputs.append(h)
            state.positions.append(explicit)
            h, index = out, index + 1
        self.position += n
        self.blocks.last_route = self.route
        return h

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for state in self._hops:
                if state.stream is not None:
                    state.stream.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
