"""One model's swarm as the dashboard shows it: a versioned, frozen ``Snapshot`` taken by a ``SwarmObserver`` from one
DHT read and one bounded round of live ``info`` calls, and the events (peers joining, leaving, changing state, the
broker changing hands) derived by diffing consecutive snapshots.

Everything a peer says is hostile. Records are signature-checked by ``RecordStore``, but what they say is the peer's
word: strings are cut to a bounded length here, numbers clamped, the peers polled per round capped, and the page puts
every string into the DOM as text, never as markup."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarm.accusations import Accusations, accusations_key
from swarm.config import Timing
from swarm.dht import RecordStore, current_broker
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.protocol import InfoReply
from swarm.quantization import describe
from swarm.records import MAX_COUNT, PeerState, Reached, ServerRecord, View, servers
from swarm.rpc.evidence import facts_or_none
from swarm.rpc.remote import Remote

log = logging.getLogger(__name__)

MAX_TEXT = 64  # longest string from a peer kept in a snapshot (device names, dtypes, runtimes)
MAX_ID_TEXT = 128  # longest peer id kept
MAX_DETAIL = 200  # longest event detail
MAX_EVENTS = 100  # recent events kept (at 50 peers a broker's hand-overs alone can make dozens)
MAX_PEERS = 512  # peers listed in one snapshot (a hostile swarm could announce any number)
MAX_POLLED = 64  # peers asked for live stats per round; the rest show what their records say
MAX_CONCURRENT = 16  # info calls in flight at once
MAX_ACCUSATIONS = 32  # accusations listed (the newest)
INFO_TIMEOUT = 3.0  # one info call at most (less if the timing's open_timeout is shorter)

EventKind = Literal["joined", "left", "state", "broker", "unreachable", "reachable", "coverage", "failover"]


def clip(text: object, limit: int = MAX_TEXT) -> str:
    """``text`` as a printable string of at most ``limit`` characters (control characters become '?')."""
    s = str(text)[: limit + 1]
    s = "".join(c if c.isprintable() else "?" for c in s)
    return s if len(s) <= limit else s[: limit - 1] + "\u2026"


def _count(n: int) -> int:
    return min(max(int(n), 0), MAX_COUNT)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class PeerView(_Frozen):
    peer_id: str
    state: str  # a PeerState value, or "unreachable" when it did not answer its info call
    start: int
    end: int
    device: str
    dtype: str
    runtime: str
    forward_tps: float  # forward tokens/s of its whole span (announced)
    inference_sps: float  # single-token inference steps/s of its whole span (announced)
    cache_free: int
    cache_total: int
    open_sessions: int = 0
    active: int = 0  # requests being processed right now
    served: int = 0
    reachable: bool | None = None  # None: not polled this round
    reached: Reached = "unmeasured"  # how it is reached (``swarm.relay``): public, through relays, or not known
    relays_for_others: bool = False


class BrokerView(_Frozen):
    holder: str
    term: int


class AccusationView(_Frozen):
    """An accusation in the DHT (``swarm.accusations``): who accused whom, the accuser's words, and whether its
    evidence checks (signed by the accused, digests and context in order); re-running it is for clients."""

    accuser: str
    accused: str
    span: str
    reason: str
    made: float
    evidence_checks: bool


class Event(_Frozen):
    at: float  # the observer's clock (wall time by default)
    kind: EventKind
    peer_id: str | None = None
    detail: str = ""


class Snapshot(_Frozen):
    v: Literal[1] = 1
    model_id: str
    num_blocks: int = Field(ge=0)
    taken_at: float
    covered: bool
    peers: tuple[PeerView, ...] = ()
    online: tuple[int, ...] = ()  # per block: online servers
    standby: tuple[int, ...] = ()  # per block: standbys holding it
    broker: BrokerView | None = None
    forward_tps: float = 0.0  # the swarm's: the bottleneck block's summed forward tokens/s
    inference_sps: float = 0.0  # ...and inference steps/s
    events: tuple[Event, ...] = ()
    dropped: int = 0  # records refused at read (unsigned, signed by another peer, malformed)
    accusations: tuple[AccusationView, ...] = ()


def peer_view(r: ServerRecord, info: InfoReply | None, polled: bool) -> PeerView:
    """What the page shows of one peer: its record, with its live stats where it answered."""
    state = r.state.value if info is not None or not polled else "unreachable"
    return PeerView(
        peer_id=clip(r.peer_id, MAX_ID_TEXT),
        state=state,
        start=r.start,
        end=r.end,
        device=clip(r.device),
        dtype=clip(describe(r.dtype, r.quantization)),  # with the quantization format, if any: "bfloat16/nf4"
        runtime=clip(r.runtime),
        forward_tps=r.forward_tps,
        inference_sps=r.inference_sps,
        cache_free=_count(info.cache_tokens_free if info is not None else r.cache_tokens_free),
        cache_total=_count(r.cache_tokens_total),
        open_sessions=_count(info.open_sessions) if info is not None else 0,
        active=_count(info.active) if info is not None else 0,
        served=_count(sum(info.stats.values()) if info is not None else r.requests_served),
        reachable=(info is not None) if polled else None,
        reached=r.reached,
        relays_for_others=r.relays_for_others,
    )


def block_counts(peers: Sequence[PeerView], num_blocks: int, state: str) -> tuple[int, ...]:
    counts = [0] * num_blocks
    for p in peers:
        if p.state == state:
            for b in range(max(p.start, 0), min(p.end, num_blocks)):
                counts[b] += 1
    return tuple(counts)


def throughput(peers: Sequence[PeerView], num_blocks: int) -> tuple[float, float]:
    """The swarm's rate: per block, the summed rates of the online servers holding it; the slowest block bounds the
    whole pipeline (0 while any block is uncovered)."""
    if num_blocks <= 0:
        return 0.0, 0.0
    fwd, inf = [0.0] * num_blocks, [0.0] * num_blocks
    for p in peers:
        if p.state == PeerState.ONLINE.value:
            for b in range(max(p.start, 0), min(p.end, num_blocks)):
                fwd[b] += p.forward_tps
                inf[b] += p.inference_sps
    return min(fwd), min(inf)


def build_snapshot(
    model_id: str,
    num_blocks: int,
    view: View,
    live: Mapping[str, InfoReply | None],
    broker: BrokerView | None,
    dropped: int,
    now: float,
) -> Snapshot:
    """A snapshot without events. ``live``: peer id -> its info reply, or None where it did not answer; a peer
    absent from ``live`` was not polled this round."""
    records = sorted(servers(view).values(), key=lambda r: (r.start, r.end, r.peer_id))[:MAX_PEERS]
    peers = tuple(peer_view(r, live.get(r.peer_id), r.peer_id in live) for r in records)
    online = block_counts(peers, num_blocks, PeerState.ONLINE.value)
    fwd, inf = throughput(peers, num_blocks)
    return Snapshot(
        model_id=clip(model_id, MAX_ID_TEXT),
        num_blocks=num_blocks,
        taken_at=now,
        covered=num_blocks > 0 and all(online),
        peers=peers,
        online=online,
        standby=block_counts(peers, num_blocks, PeerState.STANDBY.value),
        broker=broker,
        forward_tps=fwd,
        inference_sps=inf,
        dropped=_count(dropped),
    )


def _short(peer_id: str) -> str:
    return ".." + peer_id[-6:]


def diff(old: Snapshot | None, new: Snapshot, now: float) -> list[Event]:
    """What changed between two consecutive snapshots (none against the first)."""
    if old is None:
        return []
    events: list[Event] = []
    before = {p.peer_id: p for p in old.peers}
    after = {p.peer_id: p for p in new.peers}
    for pid, p in after.items():
        q = before.get(pid)
        if q is None:
            events.append(Event(at=now, kind="joined", peer_id=pid, detail=f"blocks {p.start}:{p.end}, {p.state}"))
        elif p.state == "unreachable" and q.state != "unreachable":
            events.append(Event(at=now, kind="unreachable", peer_id=pid, detail=f"blocks {p.start}:{p.end}"))
        elif q.state == "unreachable" and p.state != "unreachable":
            events.append(Event(at=now, kind="reachable", peer_id=pid, detail=f"{p.state}"))
        elif (p.state, p.start, p.end) != (q.state, q.start, q.end):
            events.append(
                Event(
                    at=now,
                    kind="state",
                    peer_id=pid,
                    detail=f"{q.state} {q.start}:{q.end} -> {p.state} {p.start}:{p.end}",
                )
            )
    events += [
        Event(at=now, kind="left", peer_id=pid, detail=f"blocks {q.start}:{q.end}")
        for pid, q in before.items()
        if pid not in after
    ]
    if old.broker != new.broker:
        if new.broker is None:
            events.append(Event(at=now, kind="broker", detail="no broker"))
        else:
            term = f"term {new.broker.term}"
            events.append(Event(at=now, kind="broker", peer_id=new.broker.holder, detail=term))
    if old.covered != new.covered:
        gaps = [str(b) for b, n in enumerate(new.online) if n == 0]
        detail = "fully covered" if new.covered else "blocks missing: " + clip(", ".join(gaps), MAX_DETAIL)
        events.append(Event(at=now, kind="coverage", detail=detail))
    return events


def merge_events(kept: Iterable[Event], new: Iterable[Event], limit: int = MAX_EVENTS) -> tuple[Event, ...]:
    return tuple(deque([*kept, *new], maxlen=limit))


class SwarmObserver:
    """Keeps the latest ``snapshot`` of one model's swarm. ``refresh`` runs on the event loop ``remote`` belongs to;
    ``snapshot`` may be read and ``note`` called from any thread."""

    def __init__(
        self,
        store: RecordStore,
        remote: Remote,
        model_id: str,
        num_blocks: int,
        timing: Timing,
        clock: Callable[[], float] = time.time,
        max_polled: int = MAX_POLLED,
        own_info: Callable[[], InfoReply] | None = None,
    ) -> None:
        """``own_info``: where the observer runs inside a peer, that peer's live stats (it cannot call itself)."""
        self.store, self.remote, self.model_id, self.num_blocks = store, remote, model_id, num_blocks
        self.own_info = own_info
        self.timing, self.clock, self.max_polled = timing, clock, max_polled
        self._lock = threading.Lock()
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._offset = 0  # rotates which peers are polled when there are more than max_polled
        self.snapshot = Snapshot(
            model_id=clip(model_id, MAX_ID_TEXT),
            num_blocks=num_blocks,
            taken_at=clock(),
            covered=False,
            online=(0,) * num_blocks,
            standby=(0,) * num_blocks,
        )
        self._first = True
        self._checked: dict[tuple[str, str, float], bool] = {}  # accusations whose evidence was checked

    def note(self, kind: EventKind, peer_id: str | None, detail: str = "") -> None:
        """Record an event seen elsewhere (the API notes a client's failover); thread-safe."""
        event = Event(
            at=self.clock(),
            kind=kind,
            peer_id=None if peer_id is None else clip(peer_id, MAX_ID_TEXT),
            detail=clip(detail, MAX_DETAIL),
        )
        with self._lock:
            self._events.append(event)
            self.snapshot = self.snapshot.model_copy(update={"events": tuple(self._events)})

    def _polled(self, records: list[ServerRecord]) -> list[ServerRecord]:
        if len(records) <= self.max_polled:
            return records
        start = self._offset % len(records)
        self._offset = start + self.max_polled
        return (records[start:] + records[:start])[: self.max_polled]

    async def _info(self, r: ServerRecord, gate: asyncio.Semaphore) -> InfoReply | None:
        timeout = min(INFO_TIMEOUT, self.timing.open_timeout)
        if self.own_info is not None and r.peer_id == self.store.peer_id:
            return self.own_info()
        async with gate:
            try:
                reply = await asyncio.wait_for(self.remote.info(Hop.of(r), timeout), timeout + 1.0)
            except (SwarmError, TimeoutError, OSError):
                return None
            except Exception as e:  # a hostile or broken peer: treated as unreachable, never as the page's failure
                log.debug("info call to %s failed: %r", r.peer_id, e)
                return None
        return reply if reply.peer_id == r.peer_id else None

    async def take(self) -> Snapshot:
        """One DHT read and one bounded round of info calls: a snapshot without events."""
        view = await asyncio.to_thread(self.store.view, self.model_id, self.num_blocks)
        broker = await asyncio.to_thread(self._broker)
        records = sorted(servers(view).values(), key=lambda r: r.peer_id)[:MAX_PEERS]
        polled = self._polled([r for r in records if r.state != PeerState.LEAVING])
        gate = asyncio.Semaphore(MAX_CONCURRENT)
        replies = await asyncio.gather(*(self._info(r, gate) for r in polled))
        live = {r.peer_id: reply for r, reply in zip(polled, replies, strict=True)}
        dropped = sum(self.store.dropped.values())
        snapshot = build_snapshot(self.model_id, self.num_blocks, view, live, broker, dropped, self.clock())
        accusations = await asyncio.to_thread(self._accusations)
        return snapshot.model_copy(update={"accusations": accusations})

    def _accusations(self) -> tuple[AccusationView, ...]:
        """The newest accusations, their evidence checked once each (remembered by accuser, accused and time)."""
        try:
            records = self.store.read(accusations_key(self.model_id), Accusations)
        except Exception:  # noqa: BLE001 - the page shows the rest of the swarm all the same
            return ()
        now = time.time() + self.timing.clock_skew  # an accusation dated ahead cannot push the others off the page
        items = sorted(((r.accuser, a) for r in records for a in r.items if a.made <= now), key=lambda x: -x[1].made)
        rows = []
        if len(self._checked) > 16 * MAX_ACCUSATIONS:
            self._checked.clear()  # bounded: accusers may write many
        for accuser, a in items[:MAX_ACCUSATIONS]:
            key = (accuser, a.accused, a.made)
            if key not in self._checked:
                self._checked[key] = facts_or_none(a.evidence, a.accused, a.start, a.end)[0] is not None
            rows.append(
                AccusationView(
                    accuser=clip(accuser, MAX_ID_TEXT),
                    accused=clip(a.accused, MAX_ID_TEXT),
                    span=f"{a.start}:{a.end}",
                    reason=clip(a.reason, MAX_DETAIL),
                    made=a.made,
                    evidence_checks=self._checked[key],
                )
            )
        return tuple(rows)

    def _broker(self) -> BrokerView | None:
        lease = current_broker(self.store, self.model_id, self.timing)
        return None if lease is None else BrokerView(holder=clip(lease.holder, MAX_ID_TEXT), term=_count(lease.term))

    async def refresh(self) -> Snapshot:
        fresh = await self.take()
        with self._lock:
            old = None if self._first else self.snapshot
            self._first = False
            self._events.extend(diff(old, fresh, fresh.taken_at))
            self.snapshot = fresh.model_copy(update={"events": tuple(self._events)})
            return self.snapshot

    async def run(self, period: float = 1.0) -> None:
        """Refresh every ``period`` seconds until cancelled; a failed round (the DHT slow or gone) is logged and
        the last snapshot kept."""
        while True:
            started = time.monotonic()
            try:
                await asyncio.wait_for(self.refresh(), self.timing.dht_timeout + INFO_TIMEOUT + 2.0)
            except Exception as e:  # noqa: BLE001 - the page keeps the last snapshot; the next round tries again
                log.warning("dashboard refresh of %s failed: %r", self.model_id, e)
            await asyncio.sleep(max(period - (time.monotonic() - started), 0.05))
