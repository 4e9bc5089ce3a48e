"""The dashboard of a 50-peer swarm in a real headless browser (Chromium through chromedriver): the page, its routes,
its HTTP server and the observer are the real ones; the swarm is 50 synthetic signed-shape records of a 48-block model
read from an in-memory store (no 50 processes), and info replies from an in-memory transport. Checked: the map is
compact, the per-block replica row heads it with each block's online count, the summary counts peers by state and
names the thinnest and thickest blocks, and two quits and two joins between two reads show as events and in the
summary's last-10-minutes count, without a reload;
a state change is listed apart, in a readable colour."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from swarm.config import Timing
from swarm.dashboard.observer import SwarmObserver
from swarm.dashboard.routes import dashboard_router
from swarm.dashboard.server import serve_in_thread
from swarm.protocol import InfoReply
from swarm.records import PeerState, ServerRecord
from tests.helpers.browser import chrome, map_peers, save_screenshot, severe, text_of, wait_until

MODEL = "random48"
BLOCKS = 48
pytestmark = pytest.mark.slow  # needs the browser (scripts/setup.sh)


def rec(i: int, start: int, end: int, state: PeerState = PeerState.ONLINE) -> ServerRecord:
    return ServerRecord(
        peer_id=f"12D3KooWPeer{i:06d}",
        state=state,
        start=start,
        end=end,
        model_id=MODEL,
        num_blocks=BLOCKS,
        fingerprint="f",
        dtype="float32",
        device="cpu",
        forward_tps=100.0,
        inference_sps=10.0,
        software_version="1",
        protocol_version=5,
    )


def fifty() -> list[ServerRecord]:
    """24 online peers of 2 blocks end to end, and 26 of 3 blocks round the model, a few standby or joining."""
    states = {30: PeerState.STANDBY, 31: PeerState.STANDBY, 40: PeerState.JOINING}
    return [rec(i, 2 * i, 2 * i + 2) for i in range(24)] + [
        rec(i, (3 * i) % 45, (3 * i) % 45 + 3, states.get(i, PeerState.ONLINE)) for i in range(24, 50)
    ]


class Store:
    def __init__(self, records: list[ServerRecord]) -> None:
        self.records = records
        self.dropped: Counter[str] = Counter()

    def view(self, model_id: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
        return {b: [r for r in self.records if r.start <= b < r.end] for b in range(num_blocks)}

    def read(self, key: str, cls: type) -> list[Any]:
        return []  # no broker lease, no accusations


class Transport:
    async def info(self, hop: Any, timeout: float) -> InfoReply:
        return InfoReply(peer_id=hop.peer_id, model_id=MODEL, fingerprint="f", cache_tokens_free=10)


def online(records: list[ServerRecord]) -> list[int]:
    return [sum(r.start <= b < r.end and r.state == PeerState.ONLINE for r in records) for b in range(BLOCKS)]


def test_fifty_peers_on_one_screen(tmp_path: Path) -> None:
    store = Store(fifty())
    observer = SwarmObserver(store, Transport(), MODEL, BLOCKS, Timing.for_tests())  # type: ignore[arg-type]
    asyncio.run(observer.refresh())
    app = FastAPI()
    app.include_router(dashboard_router({MODEL: observer}, chat=False))
    server = serve_in_thread(app, "127.0.0.1", 0, "dashboard")
    driver = chrome(tmp_path / "profile", 1400, 1000)
    try:
        driver.get(server.url + "/dashboard")
        everyone = {r.peer_id for r in store.records}
        wait_until(lambda: map_peers(driver) == everyone, 30, "the map to show all 50 peers")
        assert driver.execute_script("return document.querySelector('table.map').classList.contains('dense')")
        counts = driver.execute_script(
            "return [...document.querySelectorAll('table.map thead tr.coverage td')].map(td => td.textContent)"
        )
        assert counts == [str(n) for n in online(store.records)]
        peers = text_of(driver, ".peer-count")
        assert peers == "50 (47 online, 2 standby, 1 joining)", peers
        low, high = min(online(store.records)), max(online(store.records))
        assert text_of(driver, ".replicas").startswith(f"min {low} (block ") and f"max {high} (block " in text_of(
            driver, ".replicas"
        )
        map_bottom = driver.execute_script("return document.querySelector('table.map').getBoundingClientRect().bottom")
        assert map_bottom < 1000  # the whole map fits in the window, replica row included
        save_screenshot(driver, tmp_path / "fifty.png")

        gone, new = store.records[3:5], [rec(60, 10, 13, PeerState.JOINING), rec(61, 20, 23)]
        woke = store.records[30]  # a standby brought online: a state change, listed with the other events
        store.records = [r for r in store.records if r not in gone and r is not woke] + new
        store.records.append(rec(30, woke.start, woke.end))
        asyncio.run(observer.refresh())
        wait_until(lambda: {r.peer_id for r in new} <= map_peers(driver), 30, "the newcomers on the map")
        events = driver.execute_script(
            "return [...document.querySelectorAll('ol.churn-events li')].map(li =>"
            " [li.querySelector('.kind').textContent, li.querySelector('.mono').title,"
            " li.querySelector('.detail').textContent])"
        )
        assert sorted(e for e in events if e[0] == "left") == sorted(
            ["left", r.peer_id, f"blocks {r.start}:{r.end}"] for r in gone
        ), events
        assert sorted(e[1] for e in events if e[0] == "joined") == sorted(r.peer_id for r in new), events
        other = driver.execute_script(
            "return [...document.querySelectorAll('ol.other-events li .kind')].map(k => [k.textContent,"
            " getComputedStyle(k).color])"
        )
        assert other == [["state", other[0][1]]] and other[0][1] != "rgb(255, 255, 255)", other  # readable, not white
        assert text_of(driver, ".churn") == "2 joined, 2 left, 0 stopped answering"
        assert severe(driver) == []
        save_screenshot(driver, tmp_path / "fifty-after.png")
    finally:
        driver.quit()
        server.close()
