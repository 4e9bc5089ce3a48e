"""Inference sessions on a server: a KV cache per session under the token budget, steps checked against the
position the server holds, and the client's adapter bound (and pinned in the adapter cache) for the session's life.
Sessions are capped per caller and in total; they are keyed by caller too, so nobody can squat another's session id.
The table runs steps on the engine's ports (``peers.serving.engine``): the loaded runtime, the scheduler, the queue
quota, the limits and the counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import DynamicCache

from peers.serving.adapters import Adapter, Pin
from peers.serving.checks import check_aux, check_finite, check_hidden, check_names
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget, KvCost, recurrent, rewind
from peers.serving.limits import Quota
from peers.serving.ports import Tensors
from peers.serving.prefixes import (
    PICKS,
    SHARED,
    Claimed,
    PrefixStore,
    Scope,
    Trail,
    claim_prefix,
    copy_prefix,
    crop_to,
    eligible,
)
from peers.serving.runtime import Row
from peers.serving.scheduler import batching, pieces
from swarm import wire
from swarm.errors import (
    BadInputError,
    PeerUnavailableError,
    PrefixUnknownError,
    SessionExpiredError,
    SessionLengthError,
)
from swarm.ids import Span
from swarm.protocol import ChainRoute, OpenSession, PrefixClaim, PrefixUse
from swarm.records import Capability, ServerRecord
from swarm.rpc.claims import BLOCK


@dataclass
class Session:
    id: str
    sub: Span
    max_length: int
    batch: int
    cache: object | None  # the runtime's own KV cache (``SpanRuntime.new_cache``)
    reserved: int
    position: int = 0
    adapter: Adapter | None = None  # the client's adapter, bound for the session's life
    pin: Pin | None = None  # ...and held in the adapter cache (counted, not evictable) until the session ends
    caller: str = ""
    last_start: int | None = None  # where the last step began: a step sent again from there redoes it
    route: ChainRoute | None = None  # the client's signed route, once it gave one (``peers.rpc.chain``)
    index: int = 0  # this session's place in it
    next_hop: ServerRecord | None = None  # the signed record of the hop after it, which pushes are sent to
    room: wire.SessionRoom | None = None  # its room in the byte budget: its steps and pushes count there first
    prefix: PrefixUse | None = None  # prefix caching asked for (``peers.serving.prefixes``)...
    trail: Trail | None = None  # ...and what it has seen, while it can be kept
    reused: int = 0  # positions of its last step answered from a kept prefix
    claim: Claimed | None = None  # its first positions, claimed (``swarm.rpc.claims``), while their pieces come
    # steps waiting to run, from the client's stream and pushed by the previous hop, in arrival order
    inbox: asyncio.Queue[object] = field(default_factory=asyncio.Queue)

    @property
    def previous(self) -> str | None:
        """The peer id allowed to push into this session: the hop before it on the client's route."""
        return self.route.hops[self.index - 1].peer_id if self.route is not None and self.index > 0 else None


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

    def _keep(self, session: Session, cache: object | None) -> None:
        """An ended session's whole blocks of positions into the kept prefixes, if it asked and is whole."""
        trail, store, held = session.trail, self.prefixes, self.loaded.held
        if trail is None or store is None or session.prefix is None or held is None or session.sub not in held:
            return
        if trail.held != session.position or not isinstance(cache, DynamicCache):
            return
        store.purge(held)
        store.keep(self._scopes(session)[-1], session.caller, session.sub, trail, cache, self.loaded.current())

    @property
    def shares(self) -> bool:
        """Whether sessions that ask share kept prefixes here (``--share-prefixes``)."""
        return self.prefixes is not None and self.prefixes.share

    def _scopes(self, session: Session) -> list[Scope]:
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
            return {"hidden": self._claimed(session, position, claim, tensors)}
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
            self._scopes(session), session.sub, session.batch, seen, position, self.loaded.current()
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

    def _claimed(self, session: Session, position: int, claim: PrefixClaim, tensors: Tensors) -> torch.Tensor:
        """A claimed piece's output (``swarm.rpc.claims``). The first, at position 0 of a fresh session, finds the
        caller's kept prefix the claim names (under the session's scopes, like any reuse; ``PrefixUnknownError``
        where there is none) and copies all of it into the session; the next pieces follow it in order."""
        if tensors:
            raise BadInputError("a claimed piece carries no tensors")
        if (
            not position < claim.end <= claim.length
            or (claim.end - position) * session.batch > self.limits.max_batch_tokens
        ):
            raise BadInputError(f"a claimed piece {position}:{claim.end} of {claim.length} positions is malformed")
        if not position:
            if session.position or session.last_start is not None:
                raise BadInputError("only a session's first positions may be claimed")
            session.claim = self._find_claim(session, claim)
        held = session.claim
        if held is None or (held.length, held.digest, held.next) != (claim.length, claim.digest, position):
            raise BadInputError("a claimed piece out of order (claimed pieces come first, in order)")
        held.next = claim.end
        session.reused = claim.end - position
        self.metrics.prefix_reused += session.reused * session.batch
        self.metrics.served["inference_steps"] += 1
        return held.outputs[:, position : claim.end]

    def _find_claim(self, session: Session, claim: PrefixClaim) -> Claimed:
        if claim.length + 1 > session.max_length:
            raise SessionLengthError(
                f"session of max_length {session.max_length} cannot claim {claim.length} positions"
            )
        trail, store = session.trail, self.prefixes
        if trail is None or store is None or not isinstance(session.cache, DynamicCache):
            raise PrefixUnknownError("this session keeps no prefixes: send the step whole")
        scopes = self._scopes(session)
        weights = self.loaded.current()
        found = claim_prefix(store, trail, scopes, session.sub, session.batch, claim, session.cache, weights)
        session.position = claim.length
        return found

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
