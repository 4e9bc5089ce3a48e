"""The dashboard without a swarm: snapshots and their events from fake DHT reads and info replies (an injected
clock), the bounds on what hostile peers can put in them, the swarm's bottleneck throughput, and the HTTP routes
(pages, CSP, state JSON, the event stream, static files)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from swarm.config import Timing
from swarm.dashboard import observer as obs
from swarm.dashboard.observer import BrokerView, Snapshot, SwarmObserver, build_snapshot, diff, throughput
from swarm.dashboard.routes import CSP, dashboard_router, event_stream
from swarm.errors import PeerUnavailableError
from swarm.protocol import InfoReply
from swarm.records import PeerState, ServerRecord

MODEL = "m"
N = 6


def rec(
    pid: str,
    start: int,
    end: int,
    state: PeerState = PeerState.ONLINE,
    fwd: float = 10.0,
    inf: float = 2.0,
    device: str = "cpu",
    num_blocks: int = N,
) -> ServerRecord:
    return ServerRecord(
        peer_id=pid,
        state=state,
        start=start,
        end=end,
        model_id=MODEL,
        num_blocks=num_blocks,
        fingerprint="f",
        dtype="float32",
        device=device,
        forward_tps=fwd,
        inference_sps=inf,
        software_version="1",
        protocol_version=5,
        cache_tokens_free=100,
        cache_tokens_total=200,
        requests_served=3,
    )


def view_of(*records: ServerRecord, num_blocks: int = N) -> dict[int, list[ServerRecord]]:
    return {b: [r for r in records if r.start <= b < r.end] for b in range(num_blocks)}


def info(pid: str, free: int = 50, active: int = 1) -> InfoReply:
    return InfoReply(
        peer_id=pid,
        model_id=MODEL,
        fingerprint="f",
        stats={"forward": 4, "inference": 5},
        active=active,
        open_sessions=2,
        cache_tokens_free=free,
    )


class FakeStore:
    def __init__(self, *records: ServerRecord) -> None:
        self.records = list(records)
        self.dropped: Counter[str] = Counter()

    def view(self, model_id: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
        return view_of(*self.records, num_blocks=num_blocks)

    def read(self, key: str, cls: type) -> list[Any]:
        return []  # no broker lease


class FakeRemote:
    def __init__(self) -> None:
        self.down: set[str] = set()
        self.calls: list[str] = []

    async def info(self, hop: Any, timeout: float) -> InfoReply:
        self.calls.append(hop.peer_id)
        if hop.peer_id in self.down:
            raise PeerUnavailableError("gone")
        return info(hop.peer_id)


def make_observer(store: FakeStore, remote: FakeRemote, **kw: Any) -> tuple[SwarmObserver, list[float]]:
    now = [1000.0]
    o = SwarmObserver(store, remote, MODEL, N, Timing.for_tests(), clock=lambda: now[0], **kw)  # type: ignore[arg-type]
    return o, now


def snap(
    *records: ServerRecord,
    live: dict[str, InfoReply | None] | None = None,
    broker: BrokerView | None = None,
    now: float = 0.0,
) -> Snapshot:
    return build_snapshot(MODEL, N, view_of(*records), live or {}, broker, 0, now)


def test_snapshot_fields_coverage_and_live_stats():
    records = rec("a", 0, 3), rec("b", 3, 6), rec("c", 3, 6, PeerState.STANDBY), rec("d", 3, 6)
    s = snap(*records, live={"a": info("a"), "b": None})
    assert s.v == 1 and s.covered and s.online == (1, 1, 1, 1, 1, 1) and s.standby == (0, 0, 0, 1, 1, 1)
    assert snap(*records, live={"d": None}).online == (1, 1, 1, 1, 1, 1)  # a silent peer does not count
    a, b, c, d = s.peers
    assert (a.reachable, a.cache_free, a.served, a.active, a.open_sessions) == (True, 50, 9, 1, 2)
    assert (b.state, b.reachable) == ("unreachable", False)  # polled and silent
    assert (c.state, c.reachable, c.cache_free, c.served) == ("standby", None, 100, 3)  # not polled: its record
    assert (d.state, d.reachable) == ("online", None)
    assert Snapshot.model_validate_json(s.model_dump_json()) == s  # the JSON the page reads round-trips
    gap = snap(rec("a", 0, 3))
    assert not gap.covered and gap.online == (1, 1, 1, 0, 0, 0)


def test_throughput_is_the_bottleneck_blocks_summed_rate():
    s = snap(rec("a", 0, 3, fwd=10, inf=2), rec("b", 3, 6, fwd=4, inf=1), rec("c", 3, 6, fwd=5, inf=3))
    assert (s.forward_tps, s.inference_sps) == (9.0, 2.0)  # blocks 3:6 run at 4 + 5; inference: min(2, 1 + 3)
    s = snap(rec("a", 0, 6, fwd=10), rec("b", 0, 6, PeerState.STANDBY, fwd=100), rec("c", 0, 6, PeerState.JOINING))
    assert s.forward_tps == 10.0  # only online servers carry traffic
    assert snap(rec("a", 0, 3)).forward_tps == 0.0  # a block nobody serves: nothing gets through
    assert throughput([], 0) == (0.0, 0.0)


def test_hostile_strings_are_bounded_and_printable():
    s = snap(rec("a", 0, 6, device="x" * 10_000 + "\n<script>"))
    device = s.peers[0].device
    assert len(device) <= obs.MAX_TEXT and "\n" not in device
    assert obs.clip("ab\x00c\u202e") == "ab?c?"
    assert obs.clip("y" * 100, 10) == "y" * 9 + "\u2026"


def test_diff_events():
    a, b = rec("a", 0, 3), rec("b", 3, 6)
    first = snap(a, b)
    assert diff(None, first, 1.0) == []
    c = rec("c", 3, 6, PeerState.JOINING)
    events = diff(first, snap(a, b, c), 2.0)
    assert [(e.kind, e.peer_id, e.at) for e in events] == [("joined", "c", 2.0)]
    moved = diff(snap(a, b, c), snap(a, b, rec("c", 0, 3)), 3.0)
    assert [(e.kind, e.detail) for e in moved] == [("state", "joining 3:6 -> online 0:3")]
    gone = diff(snap(a, b), snap(a, b, live={"b": None}), 4.0)
    assert [(e.kind, e.peer_id) for e in gone] == [("unreachable", "b"), ("coverage", None)]
    back = diff(snap(a, b, live={"b": None}), snap(a, b, live={"b": info("b")}), 5.0)
    assert [e.kind for e in back] == ["reachable", "coverage"]
    left = diff(snap(a, b), snap(a), 6.0)
    assert [(e.kind, e.peer_id) for e in left] + [(e.kind, e.detail) for e in left[1:]] == [
        ("left", "b"),
        ("coverage", None),
        ("coverage", "blocks missing: 3, 4, 5"),
    ]
    brokered = diff(snap(a, b), snap(a, b, broker=BrokerView(holder="a", term=3)), 7.0)
    assert [(e.kind, e.peer_id, e.detail) for e in brokered] == [("broker", "a", "term 3")]


async def test_observer_refresh_events_clock_and_bounds():
    store, remote = FakeStore(rec("a", 0, 3), rec("b", 3, 6)), FakeRemote()
    o, now = make_observer(store, remote)
    first = await o.refresh()
    assert first.taken_at == 1000.0 and first.events == () and {p.peer_id for p in first.peers} == {"a", "b"}
    now[0] = 1001.0
    remote.down.add("b")
    second = await o.refresh()
    assert [(e.kind, e.peer_id, e.at) for e in second.events] == [
        ("unreachable", "b", 1001.0),
        ("coverage", None, 1001.0),
    ]
    store.records.pop()
    now[0] = 1002.0
    third = await o.refresh()
    assert [e.kind for e in third.events][-1:] == ["left"]
    o.note("failover", "b" * 500, "client moved off it " * 100)
    noted = o.snapshot.events[-1]
    assert noted.kind == "failover" and noted.at == 1002.0
    assert len(noted.peer_id or "") <= obs.MAX_ID_TEXT and len(noted.detail) <= obs.MAX_DETAIL
    for i in range(3 * obs.MAX_EVENTS):
        o.note("failover", str(i))
    assert len(o.snapshot.events) == obs.MAX_EVENTS and o.snapshot.events[-1].peer_id == str(3 * obs.MAX_EVENTS - 1)
    assert len((await o.refresh()).events) == obs.MAX_EVENTS


async def test_polling_is_capped_and_rotates():
    store, remote = FakeStore(*(rec(f"p{i:02d}", 0, N) for i in range(10))), FakeRemote()
    o, _ = make_observer(store, remote, max_polled=4)
    s = await o.refresh()
    assert len(remote.calls) == 4 and sum(p.reachable is None for p in s.peers) == 6
    for _ in range(2):
        await o.refresh()
    assert len(remote.calls) == 12 and set(remote.calls) == {f"p{i:02d}" for i in range(10)}


async def test_a_hanging_peer_does_not_hang_the_round(monkeypatch):
    monkeypatch.setattr(obs, "INFO_TIMEOUT", 0.2)

    class Hanging(FakeRemote):
        async def info(self, hop: Any, timeout: float) -> InfoReply:
            if hop.peer_id == "slow":
                await asyncio.sleep(3600)
            return await super().info(hop, timeout)

    o, _ = make_observer(FakeStore(rec("a", 0, 6), rec("slow", 0, 6)), Hanging())
    s = await asyncio.wait_for(o.refresh(), 5.0)
    assert {p.peer_id: p.state for p in s.peers} == {"a": "online", "slow": "unreachable"}


async def test_a_reply_naming_another_peer_counts_as_unreachable():
    class Liar(FakeRemote):
        async def info(self, hop: Any, timeout: float) -> InfoReply:
            return info("someone-else")

    o, _ = make_observer(FakeStore(rec("a", 0, 6)), Liar())
    assert (await o.refresh()).peers[0].state == "unreachable"


@pytest.fixture
def client() -> TestClient:
    o, _ = make_observer(FakeStore(rec("a", 0, 3), rec("b", 3, 6)), FakeRemote())
    asyncio.run(o.refresh())
    app = FastAPI()
    app.include_router(dashboard_router({MODEL: o}, chat=True))
    return TestClient(app)


def test_pages_carry_a_self_only_csp(client):
    r = client.get("/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/dashboard"
    for path, needle in (("/dashboard", "/static/dashboard.js"), ("/chat", "/static/chat.js")):
        r = client.get(path)
        assert r.status_code == 200 and needle in r.text and r.headers["content-type"].startswith("text/html")
        assert r.headers["content-security-policy"] == CSP
        assert "<script>" not in r.text and "http://" not in r.text and "https://" not in r.text
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP and "connect-src 'self'" in CSP


def test_chat_page_only_when_asked():
    o, _ = make_observer(FakeStore(), FakeRemote())
    app = FastAPI()
    app.include_router(dashboard_router({MODEL: o}, chat=False))
    c = TestClient(app)
    assert c.get("/chat").status_code == 404
    assert c.get("/dashboard/state").json()["chat"] is False


def test_state_json(client):
    state = client.get("/dashboard/state").json()
    assert state["v"] == 1 and state["chat"] is True
    s = Snapshot.model_validate(state["models"][MODEL])
    assert [p.peer_id for p in s.peers] == ["a", "b"] and s.covered


def test_static_files_and_traversal(client):
    for name, kind in (("dashboard.js", "javascript"), ("chat.js", "javascript"), ("dashboard.css", "css")):
        r = client.get(f"/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
        assert "innerHTML" not in r.text and "http://" not in r.text and "https://" not in r.text
    for bad in (
        "../observer.py",
        "..%2Fobserver.py",
        "%2e%2e/routes.py",
        "observer.py",
        "__init__.py",
        "..%2F..%2Fsetup.cfg",
        "/etc/passwd",
    ):
        assert client.get(f"/static/{bad}").status_code == 404, bad


async def test_event_stream_pushes_snapshots():
    o, now = make_observer(FakeStore(rec("a", 0, 6)), FakeRemote())
    await o.refresh()
    stream = event_stream({MODEL: o}, chat=False, period=0.01, lifetime=5.0)
    chunks = [c async for c in itertools_islice(stream, 2)]
    assert chunks[0].startswith("retry:") and chunks[1].startswith("data: {")
    assert '"peer_id":"a"' in chunks[1]
    await stream.aclose()


async def itertools_islice(stream: Any, n: int) -> Any:
    for _ in itertools.repeat(None, n):
        yield await stream.__anext__()


async def test_the_observing_peer_reports_itself_without_calling_itself():
    store, remote = FakeStore(rec("me", 0, 3), rec("b", 3, 6)), FakeRemote()
    store.peer_id = "me"  # type: ignore[attr-defined]
    o, _ = make_observer(store, remote, own_info=lambda: info("me", free=7))
    s = await o.refresh()
    assert remote.calls == ["b"] and s.peers[0].cache_free == 7 and s.peers[0].reachable


async def test_event_stream_ends_when_the_server_stops():
    o, _ = make_observer(FakeStore(rec("a", 0, 6)), FakeRemote())
    stopping = [False]
    stream = event_stream({MODEL: o}, chat=False, period=30.0, lifetime=60.0, stopping=lambda: stopping[0])
    assert (await stream.__anext__()).startswith("retry:")
    assert (await stream.__anext__()).startswith("data:")
    stopping[0] = True
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(stream.__anext__(), 2.0)  # within a tick, not the 30 s period


def test_serve_in_thread_on_port_zero():
    import json
    import urllib.request

    from swarm.dashboard.server import serve_in_thread

    o, _ = make_observer(FakeStore(rec("a", 0, 6)), FakeRemote())
    app = FastAPI()
    app.include_router(dashboard_router({MODEL: o}, chat=False))
    server = serve_in_thread(app, "127.0.0.1", 0)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(server.url + "/dashboard/state", timeout=5) as r:
            assert json.load(r)["models"][MODEL]["model_id"] == MODEL
    finally:
        server.close()
    assert not server._thread.is_alive()


def test_a_taken_port_is_a_clear_error():
    import socket

    from swarm.dashboard.server import serve_in_thread
    from swarm.errors import BadInputError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(BadInputError, match="cannot listen on 127.0.0.1"):
            serve_in_thread(FastAPI(), "127.0.0.1", taken.getsockname()[1], "dashboard")


def test_observers_run_on_a_connections_loop_and_stop():
    import asyncio
    import time
    from types import SimpleNamespace

    from swarm.dashboard.attach import observe_connections
    from swarm.rpc.loop import LoopThread

    class OneModelStore(FakeStore):
        """Records only under the model id they were published for, as the DHT keeps them."""

        def view(self, model_id: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
            return super().view(model_id, num_blocks) if model_id == MODEL else {}

    loop = LoopThread("test-dashboard")
    try:
        # an API serving a folder (`--model ./models/m`): served under the path, its swarm's records under the
        # folder's name, the model id its client connected with
        served = "./models/" + MODEL
        store = OneModelStore(rec("a", 0, 3), rec("b", 3, 6))
        conn = SimpleNamespace(loop=loop, store=store, remote=FakeRemote(), timing=Timing(), model_id=MODEL)
        observers, stop = observe_connections({served: (conn, N)}, period=0.05)  # type: ignore[dict-item]
        deadline = time.monotonic() + 60  # a bound on a hang only
        while not observers[served].snapshot.peers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {p.peer_id for p in observers[served].snapshot.peers} == {"a", "b"}
        assert observers[served].snapshot.covered

        async def tasks() -> set[str]:
            return {t.get_name() for t in asyncio.all_tasks()}

        assert f"dashboard-{MODEL}" in loop.run(tasks())
        stop()
        assert f"dashboard-{MODEL}" not in loop.run(tasks())  # stopped when stop() returns: no round can follow
        stop()  # idempotent
    finally:
        loop.close()
