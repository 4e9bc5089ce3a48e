"""Inference sessions on a server: a KV cache per session under the token budget, steps checked against the
position the server holds, and the client's adapter bound (and pinned in the adapter cache) for the session's life.
Sessions are capped per caller and in total; they are keyed by caller too, so nobody can squat another's session id.
The table runs steps on the engine's ports (``peers.serving.engine``): the loaded runtime, the scheduler, the queue
quota, the limits and the counters."""

from __future__ import annotations

import asyncio
from functools import partial

import torch
from transformers import DynamicCache

from peers.serving.adapters import Pin
from peers.serving.checks import check_aux, check_finite, check_hidden, check_names
from peers.serving.claiming import claimed_piece
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget, KvCost, recurrent, rewind
from peers.serving.limits import Quota
from peers.serving.ports import Tensors
from peers.serving.prefixes import (
    PICKS,
    SHARED,
    PrefixStore,
    Scope,
    copy_prefix,
    crop_to,
    eligible,
)
from peers.serving.runtime import Row
from peers.serving.scheduler import batching, pieces
from peers.serving.session import Session
from swarm.errors import (
    BadInputError,
    PeerUnavailableError,
    SessionExpiredError,
    SessionLengthError,
)
from swarm.ids import Span
from swarm.protocol import OpenSession, PrefixClaim
from swarm.records import Capability
from swarm.rpc.claims import BLOCK


class SessionTable:
    """The inference sessions open on this server, by (caller, session id), and their steps."""

    def __init__(
        self,
        engine: Engine,
        budget: CacheBudget,
        cache_wait: float,
        quota: Quota | None = None,
        cost: KvCost | None = None,
        prefill_chunk: int = 256,
    ) -> None:
        # the engine's ports it steps on (``peers.serving.engine``)
        self.loaded, self.adapters, self.scheduler = engine.loaded, engine.adapters, engine.scheduler
        self.queued, self.limits, self.metrics = engine.queued, engine.limits, engine.metrics
        self.budget = budget
        self.cost = cost  # None (servers built by hand in tests): a token of one sequence costs one unit of budget
        self.cache_wait = cache_wait
        self.prefill_chunk = max(1, prefill_chunk)  # a longer step runs in chunks, others' steps in between
        # open sessions per caller and in total (default: unbounded, for a server built without a config)
        self.quota = quota or Quota("open sessions", 1 << 30, 1 << 30, ("--max-caller-sessions", "--max-sessions"))
        self.prefixes: PrefixStore | None = None  # kept prefixes (None: the server keeps none)
        self.open: dict[tuple[str, str], Session] = {}  # by (caller, session id)
        self.changed = asyncio.Condition()  # a session opened or took a new route (a push may be waiting for it)
        # set on shutdown: new sessions go elsewhere; open ones are told in every reply (``peers.rpc.inference``) and
        # move at a step boundary, or finish
        self.leaving = False

    async def start(self, msg: OpenSession, tensors: Tensors, caller: str) -> Session:
        if self.leaving:
            raise PeerUnavailableError("this server is leaving the swarm; open the session elsewhere")
        sub, runtime = self.loaded.serve(msg.start, msg.end, Capability.INFERENCE, "an inference session")
        if (caller, msg.session_id) in self.open:
            raise BadInputError(f"session {msg.session_id} is already open here")
        self.quota.acquire(caller)  # counted from here: a session waiting for cache room holds a place too
        pin: Pin | None = None
        cache = runtime.new_cache(msg.max_length)
        try:
            adapter, pin = self.adapters.bind(caller, msg.adapter, tensors, sub)
            # kept and reused only without an adapter, on weights that do not learn, in caches that can be copied
            keeps = msg.prefix is not None and self.prefixes is not None and adapter is None and eligible(cache)
            keeps = keeps and self.loaded.learner is None
            # a trail's bytes are counted as it grows, and given up when room is needed (``PrefixStore.hold``): a
            # session that asks reserves what any other does, so routing by announced free room holds for it too
            reserved = await self.budget.reserve(self.session_cost(msg), self.cache_wait, caller)
        except BaseException:
            self.quota.release(caller)
            if pin is not None:
                pin.release()
            raise
        session = Session(
            msg.session_id,
            sub,
            msg.max_length,
            msg.batch_size,
            cache,
            reserved,
            adapter=adapter,
            pin=pin,
            caller=caller,
            prefix=msg.prefix if keeps else None,
            trail=self.prefixes.trail(caller, msg.max_length) if keeps and self.prefixes else None,
        )
        self.open[(caller, session.id)] = session
        self.metrics.served["sessions"] += 1
        await self.notify()
        return session

    def session_cost(self, msg: OpenSession) -> int:
        """What the session's caches take: its family's bytes per token and layer through its blocks."""
        if self.cost is None:
            return msg.batch_size * msg.max_length
        return self.cost.session_bytes(msg.start, msg.end, msg.batch_size, msg.max_length)

    def prefix_cost(self, sub: Span, batch: int, length: int) -> int:
        """What a kept prefix of ``length`` positions takes: its cache, its outputs and its sampled inputs."""
        kv = self.cost.session_bytes(sub.start, sub.end, batch, length) if self.cost is not None else batch * length
        rows = length + (length // BLOCK) * PICKS
        return kv + batch * rows * self.limits.hidden_size * self.limits.dtype.itemsize

    def tokens(self, nbytes: int, span: Span | None) -> int:
        """Tokens of one sequence's context that ``nbytes`` of cache hold through ``span``: what records announce
        (clients ask for batch x max_length tokens of room; the server counts bytes)."""
        if self.cost is None:
            return nbytes
        return self.cost.tokens_within(span.start, span.end, nbytes) if span is not None else 0

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, caller: str, session_id: str, generation: int, timeout: float) -> Session:
        """Session ``session_id`` of ``caller`` once it is open under route ``generation`` or newer: a step pushed
        along a route can arrive before the client's own opening (or route update) of that hop."""

        def ready() -> bool:
            s = self.open.get((caller, session_id))
            return s is not None and s.route is not None and s.route.generation >= generation

        try:
            async with asyncio.timeout(timeout), self.changed:
                await self.changed.wait_for(ready)
        except TimeoutError:
            raise BadInputError(f"no session {session_id} of {caller} under route {generation} here") from None
        return self.open[(caller, session_id)]

    async def end(self, session: Session) -> None:
        if self.open.pop((session.caller, session.id), None) is not None:
            cache, session.cache = session.cache, None
            self.scheduler.rhythm.forgot((session.caller, session.id))
            self.quota.release(session.caller)
            if session.pin is not None:
                session.pin.release()
            await self.budget.release(session.reserved, session.caller)
            self._keep(session, cache)
            if session.trail is not None:  # kept or not, the trail's bytes go back
                session.trail.drop()
                await self.notify()  # a claim may be waiting for what it kept

    def _keep(self, session: Session, cache: object | None) -> None:
        """An ended session's whole blocks of positions into the kept prefixes, if it asked and is whole."""
        trail, store, held = session.trail, self.prefixes, self.loaded.held
        if trail is None or store is None or session.prefix is None or held is None or session.sub not in held:
            return
        if trail.held != session.position or not isinstance(cache, DynamicCache):
            return
        store.purge(held)
        store.keep(self.scopes(session)[-1], session.caller, session.sub, trail, cache, self.loaded.current())

    @property
    def shares(self) -> bool:
        """Whether sessions that ask share kept prefixes here (``--share-prefixes``)."""
        return self.prefixes is not None and self.prefixes.share

    def scopes(self, session: Session) -> list[Scope]:
        """Where the session's prefixes are looked up, and (the last) kept."""
        assert session.prefix is not None and self.prefixes is not None
        own = (session.caller, session.prefix.scope)
        return [own, SHARED] if session.prefix.share and self.prefixes.share else [own]

    async def step(
        self, session: Session, position: int, tensors: Tensors, claim: PrefixClaim | None = None
    ) -> Tensors:
        """Run a step of ``tensors`` at ``position`` (``claim``: a piece of the session's first positions, sent
        without tensors: answered from a kept prefix, ``swarm.rpc.claims``)."""
        if claim is not None:
            return {"hidden": claimed_piece(self, session, position, claim, tensors)}
        check_names(tensors)
        hidden = check_hidden(tensors, self.limits)
        check_finite(hidden, "hidden")  # a NaN would poison this session's cache for every later step
        batch, n = hidden.shape[:2]
        if batch != session.batch:
            raise BadInputError(f"session was opened for batch {session.batch}, step has batch {batch}")
        # a step appends at the end, or starts inside the last step: it undoes that step from there (a chain repaired
        # upstream sends the step again; a speculative step's rejected drafts are dropped). Never further back: what
        # a client may take back is bounded by its own last step, and costs only its own cache.
        floor = session.last_start if session.last_start is not None else session.position
        if not floor <= position <= session.position:
            raise BadInputError(f"step at position {position}, but this server holds {session.position} tokens")
        held = self.loaded.held
        if held is None or session.sub not in held:
            raise PeerUnavailableError(f"this peer moved to blocks {held}; reopen the session elsewhere")
        if position + n > session.max_length:
            raise SessionLengthError(
                f"session of max_length {session.max_length} cannot take {n} more tokens at position {position}"
            )
        mask, pos = check_aux(tensors, batch, n, position + n, self.limits)
        if position < session.position:  # (part of) the last step undone: forget it first
            if recurrent(session.cache):  # a state-space state cannot be taken back: the client replays elsewhere
                await self.end(session)
                raise SessionExpiredError("this span's recurrent states cannot redo a step: reopen it and replay")
            rewind(session.cache, session.position - position)
            self.metrics.step_replays += 1
            session.position = position
        else:
            rewind(session.cache, 0)
        self.queued.acquire(session.caller)
        try:
            out = await self._reusing(session, hidden, mask, pos)
        finally:
            self.queued.release(session.caller)
        if self.prefixes is not None and not session.reused:  # past what it reuses: its caller back within its share
            self.prefixes.settle(session.caller)
        session.last_start = position
        session.position = position + n
        session.claim = None  # (a claim's pieces come before any step sent)
        self.metrics.served["inference_steps"] += 1
        return {"hidden": out}

    async def _reusing(
        self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None
    ) -> torch.Tensor:
        """The step's output, as much of it as a kept prefix of the same inputs holds taken from there (a long
        prompt comes in pieces: each may go on from where the kept one left off); recorded in the session's trail
        while the session may be kept."""
        trail, position, session.reused = session.trail, session.position, 0
        n = hidden.shape[1]
        plain = (mask is None or bool((mask == 1).all())) and (
            pos is None or torch.equal(pos, torch.arange(position, position + n).expand_as(pos))
        )
        seen = trail.ahead(position, hidden) if trail is not None and plain else None
        if trail is None or seen is None or self.prefixes is None:  # padding, own positions, a redo too far back
            if trail is not None:
                trail.drop()
            session.trail = None
            return await self._chunks(session, hidden, mask, pos)
        assert isinstance(session.cache, DynamicCache)  # ``eligible`` at the opening
        found = self.prefixes.find(
            self.scopes(session), session.sub, session.batch, seen, position, self.loaded.current()
        )
        if found is None:
            out = await self._chunks(session, hidden, mask, pos)
        else:
            end = min(found.length, position + n)
            copy_prefix(found.entry.cache, session.cache, position, end)
            outs = [found.entry.outputs[:, position:end]]
            session.position = end
            try:
                if end < position + n:
                    later = pos[:, end - position :] if pos is not None else None
                    outs.append(await self._chunks(session, hidden[:, end - position :], mask, later))
            except BaseException:  # the step failed: the session holds what it held before it, as any failed step
                crop_to(session.cache, position)
                session.position = position
                raise
            out = torch.cat([o.to(outs[-1].dtype) for o in outs], dim=1)
            session.reused = end - position
            self.metrics.prefix_reused += session.reused * session.batch
        trail.record(position, out, seen)
        return out

    async def _chunks(
        self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None
    ) -> torch.Tensor:
        """The step through the scheduler, in the turns ``pieces`` cuts it into."""
        past, prompts = session.position, session.adapter.prompt_tokens if session.adapter is not None else 0
        runtime = self.loaded.current()
        cuts = pieces(runtime, hidden.shape[1], past, self.prefill_chunk, prompts)
        if len(cuts) == 1:
            return await self._turn(session, hidden, mask, pos, past)
        outs = []
        for at, end in cuts:
            m = mask[:, : past + end] if mask is not None else None
            p = pos[:, at:end] if pos is not None else None
            outs.append(await self._turn(session, hidden[:, at:end], m, p, past + at))
        return torch.cat(outs, dim=1)

    async def _turn(
        self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None, past: int
    ) -> torch.Tensor:
        row = Row(hidden, session.cache, past, mask, pos, session.adapter)
        prompts = session.adapter.prompt_tokens if session.adapter is not None else 0
        runtime, key = batching(self.loaded.current(), session.sub, row, prompts)
        alone = partial(self._alone, session, hidden, mask, pos, past)
        lone = len(self.open) == 1
        scheduler = self.scheduler
        return await scheduler.step(
            session.caller, session.sub, row, alone, runtime, key, lone, (session.caller, session.id)
        )

    def _alone(
        self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None, past: int
    ) -> torch.Tensor:
        runtime = self.loaded.current()
        with torch.inference_mode():
            return runtime.run(
                hidden,
                session.sub,
                attention_mask=mask,
                position_ids=pos,
                cache=session.cache,
                past=past,
                adapter=session.adapter,
            )
