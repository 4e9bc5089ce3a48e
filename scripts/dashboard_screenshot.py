"""Screenshots of the dashboard and the chat page for the README: starts a local SmolLM2 swarm (three peers on
127.0.0.1), ``python -m swarm.api`` over it, and headless Chromium, then writes docs/dashboard.png and docs/chat.png.

    python scripts/dashboard_screenshot.py [--out docs] [--prompt "..."]

Every process it starts is stopped by its PID."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.local_swarm import ApiProcess  # noqa: E402
from swarm.launch import LocalSwarm  # noqa: E402
from tests.helpers.browser import chrome, map_peers, save_screenshot, wait_until  # noqa: E402

MODEL = "smollm2-135m"
STARTUP = 300.0


def chat(driver: Any, url: str, prompt: str, out: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(url + "/chat")
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 30, "the model list")
    Select(driver.find_element(By.ID, "model")).select_by_visible_text(MODEL)
    driver.find_element(By.ID, "message").send_keys(prompt)
    driver.find_element(By.ID, "send").click()
    done = ".msg.assistant.done, .msg.assistant.failed"
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, done), 300, "the answer")
    save_screenshot(driver, out / "chat.png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go (default docs/)")
    p.add_argument("--prompt", default="In two sentences, what is a peer-to-peer network?")
    p.add_argument("--throughput", default="auto", help="the peers' --throughput ('auto' measures; a number skips it)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swarm-screenshot-"))
    swarm = LocalSwarm(
        MODEL, ["0:15"], extra_args=("--throughput", args.throughput), log_dir=work / "logs", startup_timeout=STARTUP
    )
    api: ApiProcess | None = None
    driver = None
    try:
        swarm.start()
        swarm.add_peer("15:30", wait=False)
        swarm.add_peer("15:30", wait=False)
        for peer in swarm.peers:
            peer.wait_ready(STARTUP)
        api = ApiProcess(
            swarm.initial_peers,
            "--model",
            MODEL,
            test_timings=False,
            log_path=work / "api.log",
            startup_timeout=STARTUP,
        )
        base = api.url.rstrip("/")
        driver = chrome(work / "profile", 1400, 760)
        chat(driver, base, args.prompt, args.out)  # first, so the dashboard shows requests served
        driver.get(base + "/dashboard")
        everyone = {p.peer_id for p in swarm.peers}
        wait_until(lambda: map_peers(driver) >= everyone, 60, "the map to show every peer")
        time.sleep(2.0)  # one more live update, so the load columns are current
        save_screenshot(driver, args.out / "dashboard.png")
        print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'chat.png'}")
        return 0
    finally:
        if driver is not None:
            driver.quit()
        if api is not None:
            api.stop()
        swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
