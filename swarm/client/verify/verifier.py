"""Verification of an inference session's hops: each hop's work is run again on another server of the same weights
(its verifier, a ``Shadow`` session kept beside the hop's), window by window, and compared position by position
(``swarm.verdict``).

A window closes after a number of steps drawn at random (``ClientConfig.verify_every`` on average, at most twice
that): its inputs go to the verifier as one prefill on the context the verifier already holds, and its outputs are
compared with what the hop returned. So every step of every hop is checked, a window later, and no server can tell
which step ends a window. The check runs on the client's event loop beside the session, off the decode path; its
result is acted on before the next step.

On a mismatch a third runs the hop's whole context once and decides: the one of the two that disagrees with it is
the cheater. The third is the client itself where it holds the hop's weights (its model folder's, unquantized: its
own run, block by block, ``swarm.families.recompute``), so a span served by only two servers is decided too, and
no server drawn for it (perhaps a Sybil) decides; otherwise a third server (when it agrees with neither, or there
is none, nobody is blamed: the session moves off the hop, and new sessions avoid both while others serve
those blocks). The cheater is banned and, where its signed commitments
bind it to the wrong output, accused in the DHT with that evidence (``swarm.client.verify.trust``). The steps between
the cheat and its check have already run on the cheater's output: the hop is replaced (its history replayed onto
honest servers) and the session goes on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState
from swarm.client.verify.shadow import Opening, Shadow, plain_opening, step_cuts
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.records import Capability
from swarm.verdict import LOSSY, Comparison, Gaps, Tolerance, compare, tolerance

log = logging.getLogger(__name__)
Who = Literal["ok", "hop", "verifier", "unresolved", "unverifiable"]


@dataclass
class Verdict:
    state: HopState  # the hop checked
    who: Who  # who computed wrong: nobody ("ok"), the hop, its verifier, or undecided
    comparison: Comparison | None = None
    first: int = 0  # the window's first step (index into the hop's inputs)
    mine: torch.Tensor | None = None  # the hop's outputs over the window, the verifier's, and the third server's:
    theirs: torch.Tensor | None = None  # which piece of the window is wrong is read off them
    reference: torch.Tensor | None = None
    shadow: Shadow | None = None  # the verifier (evidence against it is in its own session)
    shadow_first: int = 0  # the verifier's first step of this run, and how many positions of it precede the window
    skip: int = 0
    reason: str = ""

    @property
    def cheater(self) -> str | None:
        if self.who == "hop":
            return self.state.hop.peer_id
        if self.who == "verifier" and self.shadow is not None:
            return self.shadow.hop.peer_id
        return None


@dataclass
class Watch:
    state: HopState
    due: int
    shadow: Shadow | None = None
    sent: int = 0  # the hop's steps its verifier has run (a new verifier starts from none)
    checked: int = 0  # the hop's steps compared and found right (their outputs dropped)
    final: int = 0  # the hop's steps that are final (a speculative step is, once its rejected drafts are cut)
    running: concurrent.futures.Future[Verdict] | None = None


@dataclass
class Stats:
    checks: int = 0  # windows compared
    tokens: int = 0  # positions compared
    bytes_sent: int = 0  # hidden states sent to verifiers and third servers
    own_runs: int = 0  # mismatches decided by this client's own run of the span (no third server asked)
    outcomes: Counter[str] = field(default_factory=Counter)
    closest: float = 0.0  # the largest window distance (rms) and single-position distance seen between outputs
    closest_position: float = 0.0  # that passed: the margin honest servers leave under the tolerance
    weakest_catch: float | None = None  # the failing window nearest its tolerance, in multiples of it (>1)


class Verifier:
    def __init__(
        self,
        conn: SwarmConnection,
        opening: Opening,
        max_length: int,
        batch_size: int,
        chunk: int,
        needs: frozenset[Capability],
    ) -> None:
        cfg = conn.cfg
        self.conn, self.opening, self.max_length, self.batch_size = conn, opening, max_length, batch_size
        self.chunk, self.needs = chunk, needs
        self.rng = random.Random(cfg.verify_seed) if cfg.verify_seed is not None else random.SystemRandom()
        self.gaps = Gaps(cfg.verify_every, self.rng)
        self.watches: dict[str, Watch] = {}  # by the hop's session id
        self.stats = Stats()
        self.stopped = False

    # ---- the schedule (the session's thread) ----------------------------------------------------------------------
    def after_step(self, states: list[HopState]) -> None:
        """A step went through ``states``: count it toward each hop's window, and start the checks that are due.
        Hops no longer on the route are let go (their verifiers closed)."""
        if self.stopped:
            return
        live = {s.session_id for s in states}
        for key, old in list(self.watches.items()):
            if key not in live and old.running is None:
                self._drop(key)
        for state in states:
            found = self.watches.get(state.session_id)
            watch = found if found is not None else Watch(state, self.gaps.draw())
            self.watches[state.session_id] = watch
            watch.final = len(state.replay.inputs)  # checks (on the event loop) read no further
            watch.due -= 1
            if watch.due <= 0 and watch.running is None:
                watch.due = self.gaps.draw()
                self._start(watch)

    def _drop(self, key: str) -> None:
        watch = self.watches.pop(key)
        if watch.shadow is not None:
            watch.shadow.close()

    def stop(self) -> None:
        """Verify no further step of this session (a padding mask: its steps are not plain prefixes)."""
        self.stopped = True
        self.close()
        self.watches.clear()

    def _start(self, watch: Watch) -> None:
        watch.running = asyncio.run_coroutine_threadsafe(self._check(watch), self.conn.loop.loop)

    def settle(self) -> list[Verdict]:
        """The verdicts of the checks that finished (the others go on)."""
        done: list[Verdict] = []
        for key, watch in list(self.watches.items()):
            future = watch.running
            if future is None or not future.done():
                continue
            watch.running = None
            try:
                verdict = future.result()
            except Exception as e:  # noqa: BLE001 - a check that broke is no verdict on anyone
                log.warning("a verification broke: %s", e, extra={"peer": watch.state.hop.peer_id})
                verdict = Verdict(watch.state, "unresolved", reason=str(e))
            self.stats.outcomes[verdict.who] += 1
            agreed = verdict.who == "ok" and verdict.comparison is not None and not watch.state.replay.lossy
            if agreed and watch.shadow is not None and self.conn.trust is not None:
                # two servers' work agreed, exactly: each becomes a little more a judge this client may believe
                self.conn.trust.vouch(watch.state.hop.peer_id, watch.shadow.hop.peer_id)
            if verdict.who != "ok":
                done.append(verdict)
                if verdict.who in ("verifier", "unresolved") and watch.shadow is not None:
                    watch.shadow, watch.sent = None, 0  # a fresh verifier takes the whole history next time
                    # (the verdict keeps the old one, for evidence against it; ``verdicts.act`` closes it)
            if verdict.who == "hop":
                self.watches.pop(key)  # its verifier goes with the verdict (closed once evidence is taken)
        return done

    def finish(self, timeout: float) -> list[Verdict]:
        """Check every hop's steps not yet checked (the session ends), then every verdict."""
        verdicts: list[Verdict] = []
        deadline = time.monotonic() + timeout
        for _ in range(3):  # a check that found a verifier failing leaves its window to the next round
            todo = [
                w
                for w in self.watches.values()
                if w.running is not None or (w.checked < w.final and not w.state.link.broken)
            ]
            if not todo or self.stopped:
                break
            for watch in todo:
                if watch.running is None:
                    self._start(watch)
            pending = [w.running for w in todo if w.running is not None]
            concurrent.futures.wait(pending, max(deadline - time.monotonic(), 0.0))
            verdicts += self.settle()
            if time.monotonic() >= deadline:
                break
        return verdicts

    def close(self) -> None:
        for watch in self.watches.values():
            if watch.running is not None:
                watch.running.cancel()
            if watch.shadow is not None:
                watch.shadow.close()

    # ---- one check (the event loop) --------------------------------------------------------------------------------
    def _candidates(self, hop: Hop, exclude: set[str]) -> list[Hop]:
        records = self.conn.view.servers(
            self.batch_size * self.max_length, frozenset(exclude | {hop.peer_id}), self.needs
        )
        return [Hop.of(r, hop.start, hop.end) for r in records if r.start <= hop.start and hop.end <= r.end]

    async def _check(self, watch: Watch) -> Verdict:
        try:
            return await self._compare(watch)
        except SwarmError as e:  # a verifier that fails is no evidence against the hop: another one takes over
            log.info("a verification failed: %s", e, extra={"peer": watch.state.hop.peer_id})
            self.conn.retrier.note_failure(e, "verification")
            return Verdict(watch.state, "unresolved", shadow=watch.shadow, reason=str(e))

    def _tolerance(self, state: HopState, *others: Hop) -> Tolerance:
        tol = tolerance(state.hop.dtype, *(h.dtype for h in others))
        return LOSSY if state.replay.lossy else tol

    async def _compare(self, watch: Watch) -> Verdict:
        state = watch.state
        n, checked = watch.final, watch.checked
        if checked >= n:
            return Verdict(state, "ok")
        outs = state.replay.outputs[checked:n]
        if any(o is None for o in outs):  # cannot happen: outputs are dropped only once checked
            watch.checked = n
            return Verdict(state, "unverifiable", reason="outputs missing")
        if watch.shadow is None:
            candidates = await asyncio.to_thread(self._candidates, state.hop, set())
            if not candidates:
                watch.checked = n
                for i in range(checked, n):
                    state.replay.release(i)  # never to be compared: not kept
                return Verdict(state, "unverifiable", reason="no other server holds these blocks")
            watch.shadow, watch.sent = Shadow(self.conn, self.rng.choice(candidates), self.opening, self.chunk), 0
        first, shadow = watch.sent, watch.shadow
        x = torch.cat(state.replay.inputs[first:n], dim=1)
        positions = torch.cat(state.replay.positions[first:n], dim=1)
        shadow_first = len(shadow.state.replay.inputs)
        ran = await shadow.run(x, positions, step_cuts([t.shape[1] for t in state.replay.inputs[first:n]]))
        watch.sent = n
        # already compared with an earlier verifier
        skip = sum(t.shape[1] for t in state.replay.inputs[first:checked])
        theirs = ran[:, skip:]
        mine = torch.cat([o.float() for o in outs if o is not None], dim=1)
        self.stats.checks += 1
        self.stats.tokens += mine.shape[1]
        self.stats.bytes_sent += x.numel() * x.element_size()
        cmp = compare(mine, theirs)
        tol = self._tolerance(state, shadow.hop)
        if cmp.within(tol):
            self.stats.closest = max(self.stats.closest, cmp.rms)
            self.stats.closest_position = max(self.stats.closest_position, cmp.worst)
            watch.checked = n
            for i in range(checked, n):
                state.replay.release(i)  # checked: only inputs stay (replays need them)
            return Verdict(state, "ok", cmp)
        over = max(cmp.rms / tol.rms, cmp.worst / tol.worst)
        self.stats.weakest_catch = over if self.stats.weakest_catch is None else min(self.stats.weakest_catch, over)
        verdict = Verdict(
            state,
            "unresolved",
            cmp,
            checked,
            mine,
            theirs,
            None,
            shadow,
            shadow_first,
            skip,
            f"{cmp.describe()} from {shadow.hop.peer_id}'s",
        )
        verdict.who, verdict.reference = await self._third(state, shadow, mine, theirs, n)
        log.warning(
            "verification mismatch: %s; decided: %s",
            verdict.reason,
            verdict.who,
            extra={"peer": state.hop.peer_id, "span": f"{state.hop.start}:{state.hop.end}"},
        )
        return verdict

    async def _third(
        self, state: HopState, shadow: Shadow, mine: torch.Tensor, theirs: torch.Tensor, n: int
    ) -> tuple[Who, torch.Tensor | None]:
        """A third runs the hop's whole context once: who of the hop and the verifier agrees with it. The third is
        this client itself where it holds the hop's weights (its own run decides, whatever servers exist: with two
        servers of a span nothing else could, and drawn servers may be Sybils), else a third server."""
        x = torch.cat(state.replay.inputs[:n], dim=1)
        own = await self._own_run(state, shadow, x, torch.cat(state.replay.positions[:n], dim=1))
        if own is not None:
            ref = own[:, -mine.shape[1] :]
            return self._decide(compare(mine, ref), compare(theirs, ref), self._tolerance(state, shadow.hop)), ref
        candidates = await asyncio.to_thread(self._candidates, state.hop, {shadow.hop.peer_id})
        if not candidates:
            return "unresolved", None
        self.rng.shuffle(candidates)
        # with an adapter, the third server needs it too (the session's own opening sends it)
        opening = self.opening if Capability.ADAPTERS in self.needs else plain_opening(x.shape[1], x.shape[0])
        for hop in candidates[:2]:  # a third that fails is banned and replaced once: its failure decides nothing
            third = Shadow(self.conn, hop, opening, self.chunk)
            try:
                cuts = step_cuts([t.shape[1] for t in state.replay.inputs[:n]])
                ref = (await third.run(x, torch.cat(state.replay.positions[:n], dim=1), cuts))[:, -mine.shape[1] :]
            except SwarmError as e:
                self.conn.retrier.note_failure(e, "verification")
                continue
            finally:
                third.close()
            self.stats.bytes_sent += x.numel() * x.element_size()
            return self._decide(compare(mine, ref), compare(theirs, ref), self._tolerance(state, shadow.hop, hop)), ref
        return "unresolved", None

    @staticmethod
    def _decide(hop: Comparison, verifier: Comparison, tol: Tolerance) -> Who:
        """Who computed wrong, by how each compares with the deciding run."""
        hop_ok, verifier_ok = hop.within(tol), verifier.within(tol)
        if verifier_ok and not hop_ok:
            return "hop"
        if hop_ok and not verifier_ok:
            return "verifier"
        return "unresolved"

    async def _own_run(
        self, state: HopState, shadow: Shadow, x: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The hop's blocks over ``x`` run here (None: no copy of both servers' weights here, or an adapter runs)."""
        local = self.conn.trust.local if self.conn.trust is not None else None
        hop = state.hop
        if local is None or Capability.ADAPTERS in self.needs or shadow.hop.fingerprint != hop.fingerprint:
            return None
        out = await asyncio.to_thread(local, x, hop.start, hop.end, hop.fingerprint, positions)
        if out is not None:
            self.stats.own_runs += 1
        return out
