"""The dashboard in a real headless browser (Debian's Chromium through chromedriver and Selenium) against a real
loopback swarm of SmolLM2-135M: the page loads with no console errors, the blocks x peers map shows every peer, a peer
killed during the test leaves the map without a reload, and (against ``python -m swarm.api``) a chat message streams
an answer whose route the page shows. Screenshots go to the test's tmp path (and to $SWARM_SCREENSHOT_DIR if set)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from harness.local_swarm import ApiProcess
from swarm.launch import LocalSwarm
from tests.helpers.browser import (
    chrome,
    map_peers,
    save_screenshot,
    severe,
    text_of,
    wait_until,
)
from tests.helpers.swarms import TEST_SERVER_ARGS

MODEL = "smollm2-135m"
STARTUP = 180.0
pytestmark = pytest.mark.slow  # scripts/setup.sh installs the browser: without it these fail (have_browser says why)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    logs = tmp_path_factory.mktemp("peer-logs")
    s = LocalSwarm(
        MODEL, ["0:15"], extra_args=TEST_SERVER_ARGS, test_timings=True, log_dir=logs, startup_timeout=STARTUP
    )
    s.start()
    try:
        watcher = s.add_peer("15:30", "--dashboard-port", "0", wait=False)
        s.add_peer("15:30", wait=False)  # the one the test kills
        for peer in s.peers:
            peer.wait_ready(STARTUP)
        assert "dashboard" in watcher.urls, watcher.urls
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = chrome(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield d
    finally:
        d.quit()


def test_a_malicious_peers_markup_stays_text(swarm, driver, tmp_path):
    """A real malicious process announces a validly signed record whose device name is markup (all a peer's strings
    are its own word): the page shows it as bounded text and makes no element of it."""
    watcher = swarm.peers[1]
    cmd = [
        sys.executable,
        "-m",
        "tests.helpers.attacker",
        "markup",
        "--initial-peers",
        *swarm.initial_peers,
        "--model-id",
        MODEL,
        "--num-blocks",
        "30",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    attack = json.loads(out.strip().splitlines()[-1])
    assert attack["announced"]
    driver.get(watcher.urls["dashboard"])
    try:
        wait_until(lambda: attack["attacker"] in map_peers(driver), 30, "the attacker's record on the map")
        table = text_of(driver, "table.peers")
        assert attack["markup"] in table and "<b>float32</b>" in table  # shown as text...
        assert "x" * 100 not in table  # ...and cut short
        assert (
            driver.execute_script("return document.querySelectorAll('section.model img, section.model b').length") == 0
        )
        assert driver.title == "swarm dashboard" and severe(driver) == []
        save_screenshot(driver, tmp_path / "markup.png")
    finally:
        driver.get("about:blank")


def test_dashboard_map_follows_the_swarm(swarm, driver, tmp_path):
    first, watcher, victim = swarm.peers
    everyone = {first.peer_id, watcher.peer_id, victim.peer_id}
    driver.get(watcher.urls["dashboard"])
    try:
        wait_until(lambda: map_peers(driver) >= everyone, 30, "the map to show all three peers")
        assert driver.title == "swarm dashboard"
        text = text_of(driver, "section.model")
        assert "fully covered" in text and "term" in text
        assert severe(driver) == []
        save_screenshot(driver, tmp_path / "dashboard.png")

        swarm.kill(victim)
        # no reload: the page's live events carry the change (first marked unreachable, then its records expire)
        wait_until(lambda: victim.peer_id not in map_peers(driver), 40, "the killed peer to leave the map")
        assert map_peers(driver) >= {first.peer_id, watcher.peer_id}
        events = text_of(driver, "ol.events")
        assert any(k in events for k in ("unreachable", "left")), events
        save_screenshot(driver, tmp_path / "dashboard-after-kill.png")
        assert severe(driver) == []
    finally:
        save_screenshot(driver, tmp_path / "dashboard-last.png")


def served(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return bool(r.status == 200)
    except urllib.error.URLError:
        return False


# Records the answer's length on every change, so a test sees it grow however fast the tokens come.
WATCH = """
const target = document.getElementById('messages');
window.__lengths = [];
new MutationObserver(() => {
  const m = target.querySelector('.msg.assistant:last-of-type .content');
  if (m) window.__lengths.push(m.textContent.length);
}).observe(target, {subtree: true, childList: true, characterData: true});
"""


def test_chat_streams_an_answer_through_the_api(swarm, driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    api = ApiProcess(swarm.initial_peers, "--model", MODEL, log_path=tmp_path / "api.log", startup_timeout=STARTUP)
    try:
        url = api.url.rstrip("/")
        assert served(url + "/chat")
        driver.get(url + "/dashboard")  # the API serves the dashboard too
        alive = {p.peer_id for p in swarm.peers if p.proc.poll() is None}
        wait_until(lambda: map_peers(driver) >= alive, 30, "the API's dashboard to show the live peers")
        assert severe(driver) == []

        driver.get(url + "/chat")
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 15, "the model list")
        Select(driver.find_element(By.ID, "model")).select_by_visible_text(MODEL)
        box = driver.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys("24")
        driver.execute_script(WATCH)
        driver.find_element(By.ID, "message").send_keys("Write a short poem about the sea.")
        driver.find_element(By.ID, "send").click()
        done = ".msg.assistant.done, .msg.assistant.failed"
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, done), 90, "the answer to finish")
        answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant:last-of-type")
        assert "failed" not in (answer.get_attribute("class") or ""), answer.text
        lengths = [n for n in driver.execute_script("return window.__lengths") if n > 0]
        assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths  # it grew, piece by piece
        route = answer.find_element(By.CSS_SELECTOR, ".route").text
        assert route.startswith("route: blocks 0:15 -> ..") and "15:30 -> .." in route, route
        assert severe(driver) == []
        save_screenshot(driver, tmp_path / "chat.png")
    finally:
        api.stop()
