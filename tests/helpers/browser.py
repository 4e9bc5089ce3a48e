"""Debian's Chromium driven by Selenium through chromedriver, headless, with explicit paths (so Selenium Manager
never reaches for the network), and the helpers the dashboard's browser checks share (tests, screenshot script)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def have_browser() -> bool:
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


def chrome(profile: Path, width: int = 1400, height: int = 1000) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert have_browser(), f"needs {CHROMIUM} and {CHROMEDRIVER}: Debian chromium, chromium-driver (scripts/setup.sh)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def severe(driver: Any) -> list[dict[str, Any]]:
    """The browser console's SEVERE entries since the last call (errors, failed loads, CSP violations)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_until(predicate: Any, timeout: float, what: str, period: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)


def map_peers(driver: Any) -> set[str]:
    """Peer ids in the dashboard's blocks x peers map (read in one script: the page replaces rows as it updates)."""
    rows = "table.map tbody tr[data-peer-id]"
    return set(driver.execute_script(f"return [...document.querySelectorAll('{rows}')].map(r => r.dataset.peerId)"))


def text_of(driver: Any, selector: str) -> str:
    """The rendered text of the first element ``selector`` finds, read in one script (no stale references)."""
    found = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", selector
    )
    return str(found)


def save_screenshot(driver: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    extra = os.environ.get("SWARM_SCREENSHOT_DIR")
    if extra and path.parent != Path(extra):
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)
